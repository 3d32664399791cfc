"""Whether Serve can carry one node's replicas from what runs to what an update asks for, on the room the cluster
has. A pure walk over facts gathered before it (each Ray node's free resources, where each running replica is and
what it holds), in the order Serve takes the steps with the options flagscale/serve/app.py gives it: the extra
replicas of a larger count first, then one old replica swapped for a new one at a time (with a spare, the new one
starts before the old one stops; without, after), then the surplus old ones stopped.

Serve itself waits forever for room that never comes; `run` turns that into a refusal before anything changes.
Found on a 4-GPU host: 2 one-GPU replicas becoming 2 two-GPU replicas (room for the first new one only), and 2
two-GPU replicas becoming 4 one-GPU replicas (the two extra ones first, with every GPU held).
"""

from __future__ import annotations

from dataclasses import dataclass

Resources = dict[str, float]


@dataclass(frozen=True)
class Rollout:
    free: dict[str, Resources]  # Ray node id -> what is free on it now
    old: list[tuple[str, Resources]]  # each running replica: its Ray node id and what it holds
    need: Resources  # what each replica of the new spec reserves
    count: int  # replicas asked for
    replaced: bool  # the replicas' spec changes (else only their count does)
    spare: bool = True  # a new replica may start before an old one stops (Serve's max_surge)


def stuck_at(rollout: Rollout) -> str | None:
    """None when every step of the update finds room; else which step would wait for room forever."""
    free = {node: dict(room) for node, room in rollout.free.items()}
    old = list(rollout.old)
    asked = rollout.count
    if not rollout.replaced:
        for i in range(len(old), asked):
            if not _place(free, rollout.need):
                return f"starting replica {i + 1} of {asked} ({fmt(rollout.need)}) while {len(old)} run"
        return None
    for i in range(max(0, asked - len(old))):
        if not _place(free, rollout.need):
            return f"starting extra replica {i + 1} of {asked - len(old)} ({fmt(rollout.need)}) beside the old ones"
    for i in range(min(len(old), asked)):
        if rollout.spare:
            if not _place(free, rollout.need):
                return f"starting new replica {i + 1} of {asked} ({fmt(rollout.need)}) before an old one stops"
            _stop(free, old, rollout.need)
        else:
            _stop(free, old, rollout.need)
            if not _place(free, rollout.need):
                return f"starting new replica {i + 1} of {asked} ({fmt(rollout.need)}) after an old one stopped"
    return None


def _fits(room: Resources, need: Resources) -> bool:
    return all(room.get(k, 0) >= v for k, v in need.items())


def _place(free: dict[str, Resources], need: Resources) -> bool:
    for room in free.values():
        if _fits(room, need):
            for k, v in need.items():
                room[k] = room.get(k, 0) - v
            return True
    return False


def _stop(free: dict[str, Resources], old: list[tuple[str, Resources]], need: Resources) -> None:
    """Stop one old replica: one whose node then has room for a new one if there is such (Serve picks; this is
    the kindest pick, so a refusal is never a guess)."""
    after = [
        i
        for i, (node, held) in enumerate(old)
        if _fits({k: free.get(node, {}).get(k, 0) + held.get(k, 0) for k in need}, need)
    ]
    node, held = old.pop(after[0] if after else 0)
    room = free.setdefault(node, {})
    for k, v in held.items():
        room[k] = room.get(k, 0) + v


def fmt(resources: Resources) -> str:
    return ", ".join(f"{k}:{v:g}" for k, v in sorted(resources.items())) or "nothing"
