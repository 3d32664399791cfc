"""resources.sleep_delay_s (docs/operations.md, "Idle replicas asleep"): checked against what the engine can do on
the target, and turned into the engine args that enable its sleep mode. Where the engine cannot sleep (vLLM on a
CPU, llama.cpp, SGLang; a disaggregated pool, whose KV transfer a sleeping engine would break) the key is refused,
naming the way that does work there: an idle replica stopped by autoscaling (min_replicas 0, downscale_delay_s)."""

from __future__ import annotations

from typing import Any

from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError

STOP_INSTEAD = "an idle replica can be stopped instead: min_replicas: 0 with downscale_delay_s"


def sleep_args(kind: EngineKind, delay_s: float | None, on_cpu: bool, role: str | None, where: str) -> dict[str, Any]:
    """The engine args sleep mode adds to the node's (none when `delay_s` is unset); ConfigError at
    `where` (the node's resources) when the replica cannot sleep there."""
    if delay_s is None:
        return {}
    key = f"{where}.sleep_delay_s"
    if kind.sleep_mode is None or not kind.capabilities.sleep_on_gpu:
        raise ConfigError(f"{kind.display} has no sleep mode; {STOP_INSTEAD}", key)
    if on_cpu:
        raise ConfigError(f"{kind.display} sleeps on GPUs only (this target has none); {STOP_INSTEAD}", key)
    if role:
        raise ConfigError(
            f"a disaggregated node's {role} pool cannot sleep (its replicas hand KV caches to each other); "
            f"{STOP_INSTEAD}",
            key,
        )
    return dict(kind.sleep_mode.args)


def sleep_note(serve_id: str, delay_s: float | None, kind: EngineKind) -> list[str]:
    """What dryrun says of a node whose replicas sleep."""
    if delay_s is None:
        return []
    return [
        f"serve '{serve_id}': a replica idle for {delay_s:g}s sleeps ({kind.display} sleep mode: weights to host "
        "memory, KV cache freed; its GPU memory is free for others) and the router wakes it for the next request"
    ]
