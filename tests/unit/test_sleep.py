"""Idle replicas asleep (resources.sleep_delay_s): the idle judgement, the replica's sleep controller against a
fake engine's routes, the router's wake (shared by concurrent requests, bounded, counted; awake replicas first;
requests held by an engine that fell asleep under them), and the config refused where the engine cannot sleep.
The GPU half (a real vLLM engine asleep and awake) is tests/gpu/test_sleep_wake.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from flagscale import engines
from flagscale.errors import ConfigError
from flagscale.plan.sleep import sleep_args
from flagscale.replica.sleep import IdleJudge, SleepController
from flagscale.router.wake import WakeFailed, Waker, asleep, kept_awake, prefer_awake
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import FakeEngine, started_upstreams, upstream
from tests.unit.test_gpu_planning import gpus, plan  # noqa: F401 (gpus: a fixture)

VLLM = engines.get("vllm")
RUNNING, SUCCESS = "vllm:num_requests_running", "vllm:request_success_total"


def judge(delay_s: float = 10.0) -> IdleJudge:
    return IdleJudge(delay_s, VLLM.load_metrics, VLLM.sleep_mode.activity_metrics)


@pytest.mark.parametrize(
    "reads, due",
    [
        ([(0, {RUNNING: 0, SUCCESS: 3}), (10, {RUNNING: 0, SUCCESS: 3})], [False, True]),
        ([(0, {RUNNING: 0, SUCCESS: 3}), (9.9, {RUNNING: 0, SUCCESS: 3})], [False, False]),
        # a request ran and finished between two reads: the counter moved, so the idle time starts again
        ([(0, {RUNNING: 0, SUCCESS: 3}), (5, {RUNNING: 0, SUCCESS: 4}), (14, {RUNNING: 0, SUCCESS: 4})], [0, 0, 0]),
        ([(0, {RUNNING: 1, SUCCESS: 3}), (10, {RUNNING: 1, SUCCESS: 3}), (20, {RUNNING: 0, SUCCESS: 4})], [0, 0, 0]),
        ([(0, {RUNNING: 0}), (5, {"vllm:num_requests_waiting": 2}), (6, {}), (16, {})], [0, 0, 0, 1]),
    ],
)
def test_an_engine_is_idle_when_nothing_runs_waits_or_finished_for_the_whole_delay(reads, due):
    idle = judge()
    assert [idle.due(metrics, now) for now, metrics in reads] == [bool(d) for d in due]


def test_a_woken_engine_counts_its_idle_time_from_the_wake():
    idle = judge()
    assert not idle.due({SUCCESS: 1}, 0)
    idle.reset(8)
    assert not idle.due({SUCCESS: 1}, 12)
    assert not idle.due({SUCCESS: 1}, 21.9)
    assert idle.due({SUCCESS: 1}, 22)


class FakeSleepyEngine(http.server.ThreadingHTTPServer):
    """vLLM's /metrics, /sleep, /wake_up and /is_sleeping as far as the replica's controller reads them."""

    def __init__(self):
        self.running, self.success, self.sleeping, self.calls = 0, 0, False, []
        self.sleep_status = 200
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    body = f"vllm:num_requests_running {engine.running}\nvllm:request_success_total {engine.success}\n"
                else:
                    body = json.dumps({"is_sleeping": engine.sleeping})
                self._answer(body)

            def do_POST(self):
                engine.calls.append((self.path, self.headers.get("Authorization")))
                engine.sleeping = self.path.startswith("/sleep")
                if engine.sleep_status != 200:
                    self.send_error(engine.sleep_status)
                    return
                self._answer("")

            def _answer(self, body: str):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_the_replica_sleeps_its_idle_engine_publishes_it_and_sees_the_wake():
    engine = FakeSleepyEngine()
    published, notes = [], []
    controller = SleepController(VLLM, engine.url, "k" * 20, 5.0, published.append, notes.append)
    try:
        controller.tick(0)
        engine.running = 1
        controller.tick(4)  # busy: no sleep
        engine.running, engine.success = 0, 1
        controller.tick(6)
        controller.tick(10.9)
        assert engine.calls == [] and published == []
        controller.tick(11)
        assert engine.calls == [("/sleep?level=1&mode=wait", "Bearer " + "k" * 20)]
        assert published == [True] and controller.asleep
        controller.tick(12)  # still asleep: nothing more
        assert published == [True]
        engine.sleeping = False  # the router woke it
        controller.tick(13)
        assert published == [True, False] and not controller.asleep
        controller.tick(17.9)
        assert len(engine.calls) == 1  # idle again only 4.9 s since the wake
    finally:
        engine.shutdown()


class WakeableEngine(FakeEngine):
    """A fake engine with vLLM's wake route: each wake takes `wake_s`; `wake_status` answers it."""

    def __init__(self, name: str, wake_s: float = 0.3, wake_status: int = 200):
        super().__init__(name)
        self.wake_s, self.wake_status, self.wakes = wake_s, wake_status, 0

    async def start(self, port: int = 0) -> str:
        url = await super().start(port)
        self.runner.app.router._frozen = False  # one more route on the started app (a test double only)
        self.runner.app.router.add_post("/wake_up", self.wake)
        return url

    async def wake(self, request: web.Request):
        self.wakes += 1
        await asyncio.sleep(self.wake_s)
        return web.Response(status=self.wake_status)


async def _through_router(engines_, asleep_names, requests, awake_target: int | None = None):
    ups = await started_upstreams(engines_)
    for up in ups:
        up.record.asleep = up.record.replica_id in asleep_names
        up.record.sleeps = 3 if up.record.asleep else 0
    router = bare_router(ups, "least_load")
    if awake_target is not None:  # the node's SLO planner wants this many awake (its record, as refresh reads it)
        router.waker.targets.wanted = {ups[0].record.serve_id: awake_target}
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:

            async def one():
                async with client.post(f"{url}/v1/completions", json=body) as resp:
                    return resp.status

            return await asyncio.gather(*(one() for _ in range(requests))), router, ups
    finally:
        for engine in engines_:
            await engine.runner.cleanup()


def test_concurrent_requests_for_a_sleeping_replica_share_one_wake_and_are_all_served():
    engine = WakeableEngine("a")
    statuses, router, (up,) = asyncio.run(_through_router([engine], {"a"}, 6))
    assert statuses == [200] * 6
    assert engine.wakes == 1 and len(engine.bodies) == 6
    assert up.woken == 3 and not asleep(up)
    assert router.metrics.wakes.labels("m")._value.get() == 1
    assert router.metrics.wake_seconds.labels("m")._sum.get() >= 0.3


def test_an_awake_replica_takes_the_requests_before_a_sleeping_one_is_woken():
    sleeping, awake = WakeableEngine("a"), WakeableEngine("b")
    statuses, _router, _ups = asyncio.run(_through_router([sleeping, awake], {"a"}, 3))
    assert statuses == [200] * 3
    assert sleeping.wakes == 0 and len(awake.bodies) == 3 and not sleeping.bodies


def test_a_replica_that_cannot_be_woken_is_tried_twice_then_passed_over_for_another():
    broken, other = WakeableEngine("a", wake_s=0, wake_status=500), WakeableEngine("b", wake_s=0)
    statuses, router, ups = asyncio.run(_through_router([broken, other], {"a", "b"}, 1))
    assert statuses == [200]
    assert broken.wakes == 2 and not broken.bodies and len(other.bodies) == 1
    assert router.metrics.wake_failures.labels("m")._value.get() == 1


def test_a_node_planned_in_replicas_awake_sends_its_requests_to_the_target_count_awake_first():
    """Target 1 of three (one asleep): least_load would spread the requests; all go to the first awake replica."""
    a, b, c = WakeableEngine("a"), WakeableEngine("b"), WakeableEngine("c")
    statuses, _router, _ups = asyncio.run(_through_router([a, b, c], {"a"}, 4, awake_target=1))
    assert statuses == [200] * 4
    assert len(b.bodies) == 4 and not c.bodies and not a.bodies and a.wakes == 0


def test_kept_awake_takes_awake_replicas_first_then_by_id_and_overflows_to_the_rest():
    a, b, c = upstream("a", 1, 0), upstream("b", 2, 0), upstream("c", 3, 0)
    a.record.asleep, a.record.sleeps = True, 1
    assert kept_awake([a, b, c], None) == [a, b, c] and kept_awake([a, b, c], 5) == [a, b, c]
    assert kept_awake([c, a, b], 2) == [b, c] and kept_awake([a, b, c], 0) == [b]
    first = lambda pool: pool[0]  # noqa: E731
    assert prefer_awake(first, [a, b, c], wanted=1) is b
    full = {"b"}  # b has no free slot: the other awake replica before the sleeping one
    assert prefer_awake(lambda pool: next((u for u in pool if u.replica_id not in full), "full"), [a, b, c], 1) is c


def test_a_rising_target_wakes_the_sleeping_replicas_it_takes_in_at_once():
    async def main():
        engines_ = [WakeableEngine("a", wake_s=0), WakeableEngine("b", wake_s=0), WakeableEngine("c", wake_s=0)]
        ups = await started_upstreams(engines_)
        for up in ups[:2]:  # a and b asleep, c awake
            up.record.asleep, up.record.sleeps = True, 1
        async with aiohttp.ClientSession() as session:
            waker = Waker(lambda: session, lambda: None, bare_router(ups, "least_load").metrics)
            waker.targets.wanted = {"s": 2}  # c, and one more: a (by id)
            waker.wake_wanted(ups)
            for _ in range(100):
                if ups[0].woken == 1:
                    break
                await asyncio.sleep(0.05)
        for engine in engines_:
            await engine.runner.cleanup()
        return [engine.wakes for engine in engines_]

    assert asyncio.run(main()) == [1, 0, 0]


def test_prefer_awake_falls_back_to_sleeping_replicas_when_no_awake_one_is_free():
    a, b = upstream("a", 1, 0), upstream("b", 2, 0)
    a.record.asleep, a.record.sleeps = True, 1
    assert prefer_awake(lambda pool: pool[0], [a, b]) is b
    assert prefer_awake(lambda pool: "full" if pool == [b] else pool[0], [a, b]) is a
    b.record.asleep, b.record.sleeps = True, 1
    assert prefer_awake(lambda pool: pool[-1], [a, b]) is b


def test_requests_held_by_a_replica_that_fell_asleep_under_them_get_it_woken():
    async def main():
        engine = WakeableEngine("a", wake_s=0)
        (up,) = await started_upstreams([engine])
        up.record.asleep, up.record.sleeps = True, 2
        async with aiohttp.ClientSession() as session:
            waker = Waker(lambda: session, lambda: None, bare_router([up], "least_load").metrics)
            waker.wake_held([up])  # nothing in flight: left asleep
            await asyncio.sleep(0.1)
            assert engine.wakes == 0
            up.inflight = 1
            waker.wake_held([up])
            for _ in range(100):
                if up.woken == 2:
                    break
                await asyncio.sleep(0.05)
        await engine.runner.cleanup()
        return engine.wakes, up.woken

    assert asyncio.run(main()) == (1, 2)


def test_a_wake_without_an_engine_sleep_mode_fails_clearly():
    async def main():
        engine = WakeableEngine("a")
        (up,) = await started_upstreams([engine])
        up.record.asleep, up.record.sleeps, up.record.engine = True, 1, "sglang"
        try:
            await Waker(lambda: None, lambda: None, bare_router([up], "least_load").metrics).ready(up)
        finally:
            await engine.runner.cleanup()

    with pytest.raises(WakeFailed, match="no sleep mode"):
        asyncio.run(main())


def test_an_engine_that_wakes_for_its_request_is_sent_it_at_once_and_the_wake_counted():
    async def main():
        engine = WakeableEngine("a")
        (up,) = await started_upstreams([engine])
        up.record.asleep, up.record.sleeps, up.record.engine = True, 3, "llama_cpp"
        metrics = bare_router([up], "least_load").metrics
        try:
            await Waker(lambda: None, lambda: None, metrics).ready(up)  # no session: no call to make
        finally:
            await engine.runner.cleanup()
        return engine.wakes, up.woken, metrics.wakes.labels(up.record.models[0])._value.get()

    assert asyncio.run(main()) == (0, 3, 1)


# ---- the config -------------------------------------------------------------------------------------------


def test_sleep_on_a_gpu_turns_on_the_engines_sleep_mode_and_its_routes(gpus, demo_model_path):  # noqa: F811
    from flagscale.serve.app import engine_spec

    built = plan(demo_model_path, {"num_gpus": 0.25, "sleep_delay_s": 30}, gpu_memory_utilization=0.3)
    (engine,) = built.engines
    assert "--enable-sleep-mode" in engine.argv and engine.sleep_delay_s == 30
    spec = engine_spec(built, engine)
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1" and spec.sleep_delay_s == 30
    assert any("idle for 30s sleeps" in note for note in built.notes)


def test_a_node_planned_awake_starts_max_replicas(gpus, demo_model_path):  # noqa: F811
    scaled = {"min_replicas": 0, "max_replicas": 3, "num_gpus": 0.25, "slo": {"ttft_ms": 500}}
    (engine,) = plan(demo_model_path, {**scaled, "sleep_delay_s": 30}, gpu_memory_utilization=0.3).engines
    assert engine.planned_awake and engine.initial_replicas == 3  # the unwanted ones sleep: a wake, not a start
    (awake,) = plan(demo_model_path, scaled, gpu_memory_utilization=0.3).engines
    assert not awake.planned_awake and awake.initial_replicas == 1


def test_without_sleep_nothing_changes(gpus, demo_model_path):  # noqa: F811
    from flagscale.serve.app import engine_spec

    built = plan(demo_model_path, {"num_gpus": 0.25}, gpu_memory_utilization=0.3)
    (engine,) = built.engines
    assert "--enable-sleep-mode" not in engine.argv
    assert "VLLM_SERVER_DEV_MODE" not in engine_spec(built, engine).env


def test_sleep_on_a_cpu_target_is_refused_naming_the_key_and_what_works_there(gpus, demo_model_path):  # noqa: F811
    gpus(0)
    with pytest.raises(ConfigError) as info:
        plan(demo_model_path, {"sleep_delay_s": 30})
    message = str(info.value)
    assert "resources.sleep_delay_s" in message and "GPUs only" in message
    assert "min_replicas: 0 with downscale_delay_s" in message


@pytest.mark.parametrize("delay", [0, -5, "soon"])
def test_a_bad_sleep_delay_is_refused_naming_the_key(gpus, demo_model_path, delay):  # noqa: F811
    with pytest.raises(Exception, match="sleep_delay_s"):
        plan(demo_model_path, {"sleep_delay_s": delay})


def test_engines_without_a_sleep_mode_refuse_it_naming_the_key():
    with pytest.raises(ConfigError, match=r"has no sleep mode; an idle replica can be stopped instead") as info:
        sleep_args(engines.get("sglang"), 30.0, on_cpu=False, role=None, where="serve[0](llm)", args={})
    assert info.value.where == "serve[0](llm).resources.sleep_delay_s"


def test_a_disaggregated_pool_refuses_sleep():
    with pytest.raises(ConfigError, match="decode pool cannot sleep"):
        sleep_args(VLLM, 30.0, on_cpu=False, role="decode", where="serve[0](llm).disaggregation.decode", args={})
    assert sleep_args(VLLM, None, on_cpu=True, role="decode", where="x", args={}) == {}


@pytest.mark.parametrize("on_cpu", [True, False])
def test_llama_cpp_sleeps_by_itself_on_its_idle_delay_in_whole_seconds(on_cpu):
    llama = engines.get("llama_cpp")
    assert sleep_args(llama, 2.5, on_cpu=on_cpu, role=None, where="serve[0](m)", args={}) == {"sleep_idle_seconds": 3}
    assert sleep_args(llama, 0.2, on_cpu=on_cpu, role=None, where="serve[0](m)", args={}) == {"sleep_idle_seconds": 1}


@pytest.mark.parametrize("delay", [None, 30.0])
def test_the_engines_own_idle_delay_is_refused_for_sleep_delay_s(delay):
    with pytest.raises(ConfigError, match="set resources.sleep_delay_s instead") as info:
        sleep_args(engines.get("llama_cpp"), delay, False, None, "serve[0](m)", {"sleep_idle_seconds": 5})
    assert info.value.where == "serve[0](m).engine_args.sleep_idle_seconds"


def test_dryrun_on_this_cpu_machine_refuses_sleep_with_one_clear_error_and_exit_2(tmp_path):
    from tests.conftest import demo_engine_args, run_cli, write_config

    node = {"serve_id": "a", "engine_args": demo_engine_args(), "resources": {"sleep_delay_s": 30}}
    conf = write_config(tmp_path / "conf", [node], tmp_path / "e", 18996)
    result = run_cli(conf, "action=dryrun", timeout=300)
    assert result.returncode == 2, result.output
    assert "serve[0](a).resources.sleep_delay_s: vLLM sleeps on GPUs only" in result.output
    assert "min_replicas: 0 with downscale_delay_s" in result.output


def test_a_sleep_whose_answer_fails_is_published_when_the_engine_sleeps_anyway():
    engine = FakeSleepyEngine()
    engine.sleep_status = 500
    published = []
    controller = SleepController(VLLM, engine.url, None, 1.0, published.append, lambda line: None)
    try:
        controller.tick(0)
        controller.tick(1)
        assert engine.calls == [("/sleep?level=1&mode=wait", None)]
        assert published == [True] and controller.asleep
    finally:
        engine.shutdown()
