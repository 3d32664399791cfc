"""session: a session's requests stick to the replica that served its first one."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from flagscale.router.policies.base import Policy, RequestInfo, Settings, rank_replicas, setting

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class SessionSettings(Settings):
    """session's own `routing_options`: the bound of its session table."""

    max_sessions: int = setting(
        100_000, "sessions remembered, least recently used forgotten first (about 200 bytes each).", ge=1
    )


class Session(Policy):
    """Affinity by the OpenAI `user` field, else the X-Session-Id header: a session's requests go to the replica
    that served its first one while that replica is there and its circuit closed; requests without a session,
    and a session's first request, go by least_load. The session table is an LRU of `max_sessions`, keyed by a
    16-byte digest of the client's string (however long it is, an entry costs the same)."""

    name = "session"
    settings_type = SessionSettings
    settings: SessionSettings

    def __init__(self, settings: SessionSettings | None = None):
        super().__init__(settings)
        self.sessions: OrderedDict[bytes, str] = OrderedDict()  # digest of the session key -> replica id

    @staticmethod
    def key(request: RequestInfo) -> bytes | None:
        user = request.body.get("user")
        if isinstance(user, str) and user:
            named = "user:" + user
        else:
            header = request.headers.get(SESSION_HEADER)
            if not header:
                return None
            named = "header:" + header
        return hashlib.blake2b(named.encode(errors="surrogatepass"), digest_size=16).digest()

    def select(self, upstreams, request, now):
        ranked = rank_replicas(upstreams, self.next_turn(), now)
        key = self.key(request)
        replica_id = self.sessions.get(key) if key else None
        if replica_id is not None:
            sticky = [u for u in ranked if u.replica_id == replica_id]
            return sticky + [u for u in ranked if u.replica_id != replica_id]
        return ranked

    def before_request(self, upstream, request):
        key = self.key(request)
        if key is None:
            return
        self.sessions[key] = upstream.replica_id
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.settings.max_sessions:
            self.sessions.popitem(last=False)

    def on_replica_left(self, replica_id):
        for key in [k for k, r in self.sessions.items() if r == replica_id]:
            del self.sessions[key]

    def stats(self, replica_id):
        return {"sessions": sum(1 for r in self.sessions.values() if r == replica_id)}
