"""resources.sleep_delay_s (docs/operations.md, "Idle replicas asleep"): checked against what the engine can do on
the target, and turned into the engine args that enable its sleep mode. Where the engine cannot sleep (vLLM on a
CPU, SGLang; a disaggregated pool, whose KV transfer a sleeping engine would break) the key is refused, naming the
way that does work there: an idle replica stopped by autoscaling (min_replicas 0, downscale_delay_s)."""

from __future__ import annotations

import math
from typing import Any

from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError

STOP_INSTEAD = "an idle replica can be stopped instead: min_replicas: 0 with downscale_delay_s"


def sleep_args(
    kind: EngineKind, delay_s: float | None, on_cpu: bool, role: str | None, where: str, args: dict[str, Any]
) -> dict[str, Any]:
    """The engine args sleep mode adds to the node's `args` (none when `delay_s` is unset); ConfigError at
    `where` (the pool's path) when the replica cannot sleep there, or when `args` set the engine's own idle
    delay (the router would not know that the replica sleeps)."""
    mode = kind.sleep_mode
    if mode is not None and mode.idle_arg in args:
        raise ConfigError(
            "set resources.sleep_delay_s instead: the router must know which replicas sleep",
            f"{where}.engine_args.{mode.idle_arg}",
        )
    if delay_s is None:
        return {}
    key = f"{where}.resources.sleep_delay_s"
    if mode is None or not (kind.capabilities.sleep_on_gpu or kind.capabilities.sleep_on_cpu):
        raise ConfigError(f"{kind.display} has no sleep mode; {STOP_INSTEAD}", key)
    if on_cpu and not kind.capabilities.sleep_on_cpu:
        raise ConfigError(f"{kind.display} sleeps on GPUs only (this target has none); {STOP_INSTEAD}", key)
    if role:
        raise ConfigError(
            f"a disaggregated node's {role} pool cannot sleep (its replicas hand KV caches to each other); "
            f"{STOP_INSTEAD}",
            key,
        )
    if mode.sleeps_by_itself:  # whole seconds: the engine's flag takes no fraction
        return {**mode.args, mode.idle_arg: max(1, math.ceil(delay_s))}
    return dict(mode.args)


def sleep_note(serve_id: str, delay_s: float | None, kind: EngineKind) -> list[str]:
    """What dryrun says of a node whose replicas sleep."""
    if delay_s is None or kind.sleep_mode is None:
        return []
    how = "wakes by itself for" if kind.sleep_mode.sleeps_by_itself else "the router wakes it for"
    return [
        f"serve '{serve_id}': a replica idle for {delay_s:g}s sleeps ({kind.display} sleep mode: "
        f"{kind.sleep_mode.asleep_means}) and {how} the next request"
    ]
