"""A ZMQ subscription read at the loop's wakes (flagscale/router/zmq_subscription.py), on real loopback sockets."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from flagscale.net import free_port
from flagscale.router import zmq_subscription
from flagscale.router.zmq_subscription import Subscription


async def _joined(pub, sub: Subscription, timeout_s: float = 10.0) -> None:
    """Until the subscription receives (a PUB drops what no subscriber has joined for yet): probes, read and
    dropped."""
    deadline = time.monotonic() + timeout_s
    while True:
        await pub.send_multipart([b"probe"])
        try:
            await asyncio.wait_for(sub.ready(), 0.2)
            list(sub.queued())
            return
        except TimeoutError:
            assert time.monotonic() < deadline, "the subscription never received a probe"


def _pair():
    port = free_port()
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    return pub, Subscription(zmq.asyncio.Context.instance(), f"tcp://127.0.0.1:{port}", "")


def test_a_burst_is_read_at_one_wake_and_a_later_message_wakes_the_reader():
    async def scenario():
        pub, sub = _pair()
        try:
            await _joined(pub, sub)
            for i in range(50):
                await pub.send_multipart([b"t", i.to_bytes(2, "big")])
            got: list[int] = []
            deadline = time.monotonic() + 10
            while len(got) < 50:
                assert time.monotonic() < deadline, f"read {len(got)} of 50"
                await asyncio.wait_for(sub.ready(), 10)
                got += [int.from_bytes(frames[1], "big") for frames in sub.queued()]
            assert got == list(range(50))
            assert list(sub.queued()) == []  # nothing left, nothing blocks

            async def later():
                await asyncio.sleep(0.3)
                await pub.send_multipart([b"t", b"\x00\x63"])

            sender = asyncio.get_running_loop().create_task(later())
            await asyncio.wait_for(sub.ready(), 10)  # the FD wakes the loop: no poll of our own
            assert [frames[1] for frames in sub.queued()] == [b"\x00\x63"]
            await sender
        finally:
            sub.close()
            pub.close(0)

    asyncio.run(scenario())


def test_a_stream_read_moments_ago_waits_out_the_coalescing_without_spinning_the_loop():
    async def scenario():
        pub, sub = _pair()
        try:
            await _joined(pub, sub)
            await pub.send_multipart([b"t", b"1"])
            await asyncio.wait_for(sub.ready(), 10)
            list(sub.queued())
            await pub.send_multipart([b"t", b"2"])
            began = time.monotonic()
            await asyncio.wait_for(sub.ready(), 10)
            assert time.monotonic() - began >= zmq_subscription.COALESCE_S * 0.9
            assert [frames[1] for frames in sub.queued()] == [b"2"]
            # a message queued while nobody reads: the FD's signal is consumed, the loop idles (a readable FD left
            # as it is would run the reader on every turn of the loop)
            await pub.send_multipart([b"t", b"3"])
            await asyncio.sleep(0.1)
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            assert time.process_time() - cpu < 0.25
            await asyncio.wait_for(sub.ready(), 10)
            assert [frames[1] for frames in sub.queued()] == [b"3"]
        finally:
            sub.close()
            pub.close(0)

    asyncio.run(scenario())


def test_a_message_that_comes_after_the_coalescing_window_costs_no_timer(monkeypatch):
    """A quiet stream (an engine's batch every few steps) is read at the FD's wake alone: the reader waits for the
    message first and sleeps out the coalescing window only when the message came within it."""
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def counted_sleep(delay: float, *args):
        sleeps.append(delay)
        return await real_sleep(delay, *args)

    async def scenario():
        pub, sub = _pair()
        try:
            await _joined(pub, sub)
            await real_sleep(0.3)  # a probe still on its way is read and dropped
            list(sub.queued())
            await pub.send_multipart([b"t", b"read just now"])
            await asyncio.wait_for(sub.ready(), 10)
            assert [frames[1] for frames in sub.queued()] == [b"read just now"]
            monkeypatch.setattr(zmq_subscription.asyncio, "sleep", counted_sleep)
            reading = asyncio.get_running_loop().create_task(sub.ready())  # asked at once after the last read
            await real_sleep(zmq_subscription.COALESCE_S * 5)
            await pub.send_multipart([b"t", b"quiet"])
            await asyncio.wait_for(reading, 10)
            assert [frames[1] for frames in sub.queued()] == [b"quiet"]
            assert sleeps == []
        finally:
            sub.close()
            pub.close(0)

    asyncio.run(scenario())
