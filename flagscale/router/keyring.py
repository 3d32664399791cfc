"""Which client keys a router accepts, and the key it sends the engines (docs/operations.md, "Rotating the key").

Clients and engines have keys of their own, so that changing the clients' key touches no engine:

- the engines require the deployment's engine key, a random secret made once in the exp_dir (ENGINE_KEY_FILE,
  0600), never a client's key. The router sends it in place of the client's `Authorization`; `status` and the
  replicas' own metrics reads send it too. A new `deploy.api_key` changes nothing an engine was started with, so
  none is replaced and none refuses the router meanwhile;
- the router accepts the keys of its spec's `client_keys`. It holds no key, only each key's HMAC under the
  deployment's secret (the peer secret, in its init args), so the keys can travel in its user_config, which a
  running router takes in place (Router.reconfigure, no restart) while Serve's status, which shows user_configs,
  shows nothing a key could be checked against. Each accepted key has an end: None for the current key, a wall
  clock time for the keys it replaced (`rotated`), after which they are refused.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flagscale.secrets import secret_file

ENGINE_KEY_FILE = "engine_api_key"  # in the exp_dir, 0600: what the engines require (engine_key)
MAX_RETIRING = 3  # earlier keys still in their grace period after a rotation: the most kept (the latest first)
_DOMAIN = b"flagscale client key\0"  # (the peer secret also signs routing hints: peers.py)


@dataclass(frozen=True)
class AcceptedKey:
    digest: str  # client_digest of the key
    until: float | None = None  # accepted until this wall clock time (time.time()); None: the current key


def engine_key(exp_dir: str | Path) -> str:
    """The deployment's engine key: read from the exp_dir's ENGINE_KEY_FILE, made there by the first run."""
    return secret_file(Path(exp_dir) / ENGINE_KEY_FILE)


def engine_key_if_made(exp_dir: str | Path) -> str | None:
    """The engine key where the deployment has one, else None (nothing is made: for readers such as status)."""
    path = Path(exp_dir) / ENGINE_KEY_FILE
    return engine_key(exp_dir) if path.exists() else None


def client_digest(secret: str | None, key: str) -> str:
    """What a router is given of a client key: its HMAC-SHA256 under the deployment's secret."""
    return _hmac(secret, key.encode())


def _hmac(secret: str | None, key: bytes) -> str:
    return hmac.new((secret or "").encode(), _DOMAIN + key, hashlib.sha256).hexdigest()


def header_key(header: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    scheme, _, key = header.partition(" ")
    return key if scheme == "Bearer" and key else None


def accepts(keys: Sequence[AcceptedKey], secret: str | None, header: str, now: float) -> bool:
    """Whether `header` (a request's Authorization) carries a key of `keys` that is still accepted at `now` (wall
    clock). Every key is compared (in constant time), so how long it takes says nothing of which one matched."""
    key = header_key(header)
    # (aiohttp keeps header bytes that are not UTF-8 as surrogates: their bytes are what is compared)
    given = _hmac(secret, key.encode(errors="surrogateescape")) if key else ""
    found = False
    for accepted in keys:
        live = accepted.until is None or now < accepted.until
        found |= hmac.compare_digest(given.encode(), accepted.digest.encode()) and live
    return found


def current_keys(secret: str | None, key: str | None) -> tuple[AcceptedKey, ...]:
    """A fresh deployment's keys: `key` alone, or none (a router without a key)."""
    return (AcceptedKey(client_digest(secret, key)),) if key else ()


def rotated(running: Iterable[AcceptedKey], new: str | None, now: float, retire_by: float) -> tuple[AcceptedKey, ...]:
    """The keys a router accepts once `new` (a client_digest; None: no key) is the current one: `new`, and the
    keys of `running` still accepted at `now`, each until `retire_by` at the latest (the latest MAX_RETIRING).
    Without a new key nothing is kept: a router without a key takes every request anyway. The same key again
    keeps every end as it was, unless `retire_by` comes sooner."""
    if new is None:
        return ()
    kept = [k for k in running if k.digest != new and (k.until is None or k.until > now)]
    retiring = [AcceptedKey(k.digest, retire_by if k.until is None else min(k.until, retire_by)) for k in kept]
    return (AcceptedKey(new), *retiring[:MAX_RETIRING])


def keys_from_json(raw: Iterable[dict]) -> tuple[AcceptedKey, ...]:
    """`client_keys` as a user_config holds them (dicts) -> AcceptedKey."""
    return tuple(AcceptedKey(str(k["digest"]), None if k.get("until") is None else float(k["until"])) for k in raw)
