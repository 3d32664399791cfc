"""Failover through the router on real sockets, against small fake engines that speak vLLM's streaming format
(token ids included when asked) and can die part-way: a request whose replica fails before answering goes to
another replica, a stream that breaks off goes on from another replica exactly where it stopped (same id, the
same tokens an unbroken run gives), and when that is not possible the stream ends with a clean error event."""

from __future__ import annotations

import asyncio
import json

from flagscale.router.resume import ClientStream, unresumable
from tests.unit.fakes import (
    FakeEngine,
    events,
    greedy,
    part_of_a_character,
    streamed_text,
    text_of,
    through_router,
    tokenize,
)


def test_completion_stream_resumes_on_another_replica_exactly_where_it_broke_off():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    dying, spare = FakeEngine("dying", die_after=5), FakeEngine("spare")
    status, raw, router = asyncio.run(through_router([dying, spare], "/v1/completions", body))
    assert status == 200
    evs = events(raw)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs if isinstance(e, dict))
    assert streamed_text(raw) == text_of(greedy(tokenize("hello"), 12))  # what an unbroken run streams
    chunks = [e for e in evs if isinstance(e, dict)]
    assert {c["id"] for c in chunks} == {"cmpl-dying-1"} and {c["created"] for c in chunks} == {1001}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the client did not ask for token ids: none reach it
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    # the spare got the prompt's tokens plus the 5 generated, for the 7 still missing
    path, resumed = spare.bodies[0]
    assert path == "/v1/completions"
    assert resumed["prompt"] == tokenize("hello") + greedy(tokenize("hello"), 5) and resumed["max_tokens"] == 7
    assert dying.bodies[0][1]["return_token_ids"] is True and "return_token_ids" not in body
    stats = router.collect_stats()
    assert stats["moved"] == 1 and stats["resumed"] == 1 and stats["replicas"]["dying"]["migrations"] == 1


def test_chat_stream_resumes_as_chat_chunks_with_usage_over_both_parts():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    dying, spare = FakeEngine("dying", die_after=4), FakeEngine("spare")
    status, raw, _ = asyncio.run(through_router([dying, spare], "/v1/chat/completions", body))
    assert status == 200
    prompt_ids = [1, 2, len("hi there")]
    assert streamed_text(raw, chat=True) == text_of(greedy(prompt_ids, 10))
    chunks = [e for e in events(raw) if isinstance(e, dict)]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {
        "chatcmpl-dying-1"
    }
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["prompt_token_ids"] is None
    assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    path, resumed = spare.bodies[0]
    assert path == "/v1/completions" and resumed["prompt"] == prompt_ids + greedy(prompt_ids, 4)
    assert resumed["max_tokens"] == 6 and resumed["stream_options"] == {"include_usage": True}


def test_client_asking_for_token_ids_gets_them_across_the_resume():
    body = {"model": "m", "prompt": "abc", "max_tokens": 6, "stream": True, "return_token_ids": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("a", die_after=2), FakeEngine("b")], "/v1/completions", body)
    )
    ids = [t for e in events(raw) if isinstance(e, dict) for t in e["choices"][0]["token_ids"]]
    assert status == 200 and ids == greedy(tokenize("abc"), 6)


def test_stream_broken_part_way_through_a_character_resumes_from_its_last_whole_one():
    body = {"model": "m", "prompt": "zz", "max_tokens": 12, "stream": True, "temperature": 0}
    tokens = greedy(tokenize("zz"), 12)
    assert part_of_a_character(tokens[1]) and not part_of_a_character(tokens[0])
    dying, spare = FakeEngine("dying", die_after=2), FakeEngine("spare")  # cut after the half character
    status, raw, _ = asyncio.run(through_router([dying, spare], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(tokens)  # no prompt echoed, nothing twice
    assert spare.bodies[0][1]["prompt"] == tokenize("zz") + tokens[:1] and spare.bodies[0][1]["max_tokens"] == 11

    with_ids = {**body, "return_token_ids": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("a", die_after=2), FakeEngine("b")], "/v1/completions", with_ids)
    )
    ids = [t for e in events(raw) if isinstance(e, dict) for t in e["choices"][0]["token_ids"]]
    assert status == 200 and ids == tokens and streamed_text(raw) == text_of(tokens)


def test_resumed_stream_does_not_send_again_the_text_the_client_has():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "stream": True}
    prompt_ids = [1, 2, len("hi there")]
    tokens = greedy(prompt_ids, 10)
    stream = ClientStream("/v1/chat/completions", chat)
    stream.first_request(b"")
    first = {"id": "c", "created": 1, "model": "m", "prompt_token_ids": prompt_ids}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}
    stream.feed(b"data: " + json.dumps(first | {"choices": [role]}).encode() + b"\n\n")
    # one chunk of two tokens whose text is whole: which token completed it is unknown, so both go again
    two = {"index": 0, "delta": {"content": "ab"}, "token_ids": tokens[:2], "finish_reason": None}
    assert b'"ab"' in stream.feed(b"data: " + json.dumps({"id": "c", "choices": [two]}).encode() + b"\n\n")
    path, body = stream.resume_request()
    assert json.loads(body)["prompt"] == prompt_ids and json.loads(body)["max_tokens"] == 10
    again = [{"text": "a", "token_ids": tokens[:1]}, {"text": "bc", "token_ids": tokens[1:2]}]
    out = [stream.feed(b"data: " + json.dumps({"id": "x", "choices": [c]}).encode() + b"\n\n") for c in again]
    assert out[0] == b"" and json.loads(out[1][6:])["choices"][0]["delta"] == {"content": "c"}
    assert stream.generated == tokens[:2] and stream.clean == 2


def test_stream_that_cannot_move_ends_with_an_error_event_not_a_cut():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("dying", die_after=3), FakeEngine("spare")], "/v1/completions", body, 0)
    )
    evs = events(raw)
    assert status == 200 and evs[-1] == "[DONE]" and "broke off the stream" in evs[-2]["error"]["message"]
    assert streamed_text(b"\n\n".join(raw.split(b"\n\n")[:3])) == text_of(greedy(tokenize("hello"), 3))


def test_unresumable_stream_gets_an_error_event_and_is_not_run_twice():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "stop": ["<5>"]}
    spare = FakeEngine("spare")
    status, raw, _ = asyncio.run(through_router([FakeEngine("dying", die_after=3), spare], "/v1/completions", body))
    assert status == 200 and "cannot be resumed" in events(raw)[-2]["error"]["message"]
    assert spare.bodies == []
    assert unresumable("/v1/completions", body) == "stop strings"


def test_replica_failing_before_answering_hands_the_request_to_another():
    body = {"model": "m", "prompt": "x", "max_tokens": 3}
    failing, good = FakeEngine("failing", status=500), FakeEngine("good")
    status, raw, router = asyncio.run(through_router([failing, good], "/v1/completions", body))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == text_of(greedy(tokenize("x"), 3))
    assert len(failing.bodies) == 1 and len(good.bodies) == 1
    assert router.collect_stats()["replicas"]["failing"]["migrations"] == 1


def test_every_replica_failing_returns_the_last_answer_each_tried_once():
    engines = [FakeEngine(f"e{i}", status=503) for i in range(3)]
    status, raw, _ = asyncio.run(through_router(engines, "/v1/completions", {"model": "m", "prompt": "x"}))
    assert status == 503 and [len(e.bodies) for e in engines] == [1, 1, 1]


def test_stripping_token_ids_gives_back_the_bytes_the_engine_sends_without_them():
    plain = (
        b'data: {"id":"cmpl-1","object":"text_completion","created":5,"model":"m","choices":[{"index":0,'
        b'"text":"\xc3\xa9","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
        b'"token_ids":null}]}\n\n'
    )
    with_ids = plain.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1,2]').replace(
        b'"token_ids":null', b'"token_ids":[7]'
    )
    stream = ClientStream("/v1/completions", {"model": "m", "prompt": "ab", "stream": True})
    assert stream.feed(with_ids[:40]) == b""  # half an event waits for the rest
    assert stream.feed(with_ids[40:]) == plain
    assert stream.prompt_ids == [1, 2] and stream.generated == [7] and stream.can_resume()


def test_stream_resumes_only_on_a_replica_of_the_same_model_version():
    """An in-place update that changed the model: replicas of both versions serve "m" for a while. A stream broken
    off on an old one goes on on the other old one, not on a new one the policy would pick first."""
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    dying, new = FakeEngine("dying", die_after=5, fingerprint="v1"), FakeEngine("new", fingerprint="v2")
    old = FakeEngine("old", fingerprint="v1")
    status, raw, router = asyncio.run(through_router([dying, new, old], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 12))
    assert new.bodies == [] and len(old.bodies) == 1
    assert router.collect_stats()["resumed"] == 1


def test_stream_with_no_replica_of_its_model_version_left_ends_with_an_error_event_not_mixed_output():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    dying, new = FakeEngine("dying", die_after=5, fingerprint="v1"), FakeEngine("new", fingerprint="v2")
    status, raw, _ = asyncio.run(through_router([dying, new], "/v1/completions", body))
    assert status == 200 and new.bodies == []  # nothing of the new model in this answer
    assert streamed_text(raw) == text_of(greedy(tokenize("hello"), 5))
    error = next(e for e in events(raw) if isinstance(e, dict) and "error" in e)["error"]["message"]
    assert "run another version of it" in error and "dying" in error


def test_a_request_the_client_has_nothing_of_yet_may_go_to_another_version():
    body = {"model": "m", "prompt": "hello", "max_tokens": 6, "stream": True}
    dying, new = FakeEngine("dying", die_after=0, fingerprint="v1"), FakeEngine("new", fingerprint="v2")
    status, raw, _ = asyncio.run(through_router([dying, new], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 6)) and len(new.bodies) == 1
