"""The router's per-chunk hot path (ClientStream._one_token): on events shaped as vLLM writes them, it must give
the client exactly what the full parse gives (and what vLLM sends when no token ids are asked for), track the
same tokens for a resume, and leave every other event to the full parse."""

from __future__ import annotations

import json

import pytest

from flagscale.router import resume
from flagscale.router.resume import COMPLETIONS, ClientStream


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def completion_choice(text: str, ids, finish=None, prompt_ids=None) -> dict:
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": prompt_ids,
        "token_ids": ids,
    }


def completion(text: str, ids, finish=None, prompt_ids=None) -> bytes:
    choice = completion_choice(text, ids, finish, prompt_ids)
    return event({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", "choices": [choice]})


def chat(content: str | None, ids, finish=None, prompt_ids=None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]}
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = prompt_ids
    return event(chunk)


STREAMS = {
    "completions": [
        completion(" Hello", [11], prompt_ids=[1, 2, 3]),
        completion(" wor", [12]),
        completion("", [13]),  # part of a character: no text yet
        completion('ld "quoted" \\ {"token_ids":[9]} 世界', [14]),
        completion(" two", [15, 16]),  # several tokens in one chunk
        completion(".", [17], finish="length"),
        b"data: [DONE]\n\n",
    ],
    "chat": [
        chat("", [], prompt_ids=[1, 2]),
        chat(" Hi", [21]),
        chat(" there", [22]),
        chat(None, [23]),
        chat("!", [24], finish="stop"),
        b"data: [DONE]\n\n",
    ],
}


def through(path: str, body: dict, events: list[bytes], quick: bool, monkeypatch) -> tuple[bytes, ClientStream]:
    stream = ClientStream(path, body)
    stream.first_request(b"")
    if not quick:
        monkeypatch.setattr(stream, "_one_token", lambda event: None)
    out = b"".join(stream.feed(e) for e in events)
    return out, stream


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("wants_ids", [False, True])
def test_the_hot_path_gives_what_the_full_parse_gives(kind, wants_ids, monkeypatch):
    path = COMPLETIONS if kind == "completions" else resume.CHAT
    body = {"model": "m", "stream": True, "max_tokens": 20, "return_token_ids": wants_ids}
    body.update({"prompt": "p"} if kind == "completions" else {"messages": [{"role": "user", "content": "p"}]})
    quick, quick_stream = through(path, body, STREAMS[kind], True, monkeypatch)
    full, full_stream = through(path, body, STREAMS[kind], False, monkeypatch)
    quick_events = [json.loads(e[6:]) for e in quick.split(b"\n\n") if e and e != b"data: [DONE]"]
    full_events = [json.loads(e[6:]) for e in full.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert quick_events == full_events
    for name in ("generated", "clean", "text_since_clean", "prompt_ids", "finished", "done", "sent_events"):
        assert getattr(quick_stream, name) == getattr(full_stream, name), name


def test_the_hot_path_writes_vllms_own_bytes_and_tracks_the_token():
    stream = ClientStream(COMPLETIONS, {"model": "m", "prompt": "p", "stream": True})
    stream.first_request(b"")
    stream.feed(completion(" a", [5], prompt_ids=[1, 2]))
    hot = completion(" b", [6])
    assert stream.feed(hot) == completion(" b", None)  # as vLLM streams it when no ids are asked for
    assert stream.generated == [5, 6] and stream.clean == 2 and stream.text_since_clean == ""
    assert stream._one_token(completion(" c", [7])[:-2]) == completion(" c", None)[:-2]  # the hot path took it


@pytest.mark.parametrize(
    "chunk",
    [
        completion(" a", [5], prompt_ids=[1]),  # the first chunk: the prompt's ids
        completion(" a", [5, 6]),  # several tokens
        completion("", [5]),  # no text: not a clean token
        completion(" a", [5], finish="length"),  # the last chunk
        event({"error": {"message": "x", "token_ids": [1]}}),
        event({"id": "c", "choices": [completion_choice(" a", [5]), completion_choice(" b", [6])]}),
        b'data: {"id":"c","choices":[{"index":0,"text":" a","finish_reason":null,"token_ids": [5]}]}\n\n',
    ],
)
def test_other_events_take_the_full_parse(chunk):
    stream = ClientStream(COMPLETIONS, {"model": "m", "prompt": "p", "stream": True})
    stream.first_request(b"")
    stream.feed(completion(" a", [5], prompt_ids=[1, 2]))
    assert stream._one_token(chunk[:-2]) is None
