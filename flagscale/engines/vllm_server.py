"""`python -m flagscale.engines.vllm_server <vllm serve args>`: vLLM's OpenAI server
(`vllm.entrypoints.openai.api_server`, unchanged) for a prefill or decode replica, whose NIXL progress thread
pauses between polls where vLLM runs on CPU.

NIXL 1.5.1's Python API starts every agent with a progress thread that polls UCX with no pause (it sets the
thread's delay to 0), so each engine with a NixlConnector keeps one core busy for as long as it lives, idle or
not; vLLM has no option for it. On a GPU host that is a spare core buying the shortest transfers. On a CPU host
it is a core taken from the engines' own compute: on a 2-core machine like CI's, with 2 prefill + 1 decode
engines and a colocated one, the 32 requests of tests/e2e/test_disaggregation.py's answers test took 112 s with
busy threads (docs/disaggregation.md). Turning the thread off frees the core but leaves UCX to progress only
inside the engine's own NIXL calls, once per engine step: a 15 MB KV transfer then took 1.8-2.1 s instead of
9 ms. A pause of 100 us between polls keeps transfers in the background at ~2 % of a core when idle.

vLLM's automatic CPU binding (VLLM_CPU_OMP_THREADS_BIND=auto, what a single-rank replica gets) keeps one more
core per rank away from the workers when a KV connector is set, for that busy thread. Where the host has no core
to spare it binds the worker's OpenMP threads over every core instead, shared with the other engines and the
API servers: on 2 cores the decode step took 8x as long (docs/disaggregation.md). With the thread paused, the
server here gives vLLM the reservation it makes without a connector, one core for a one-rank replica
(VLLM_CPU_NUM_OF_RESERVED_CPU), unless the environment sets either variable.

FLAGSCALE_NIXL_PROGRESS_PAUSE_US (experiment.envs): the pause, in microseconds, on any host; `0` is NIXL's own
busy polling. Unset: 100 on CPU, NIXL's default on GPUs. The NIXL agents live in the engine core (or its
workers), which vLLM on CPU always spawns (never forks): a spawned process imports its parent's `__main__` module
again as `__mp_main__` before it runs, so this module stays `__main__` while vLLM's server runs in it, and applies
the same pause when imported so.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from collections.abc import Mapping
from typing import Any

PAUSE_ENV = "FLAGSCALE_NIXL_PROGRESS_PAUSE_US"
CPU_PAUSE_US = 100
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def parse_pause_us(value: str) -> int:
    """PAUSE_ENV's value; ValueError naming it otherwise (the config schema checks it before anything starts)."""
    if not value.strip().isdigit():
        raise ValueError(f"{PAUSE_ENV}={value!r}: microseconds, a whole number (0: NIXL's busy polling)")
    return int(value)


def progress_pause_us(env: Mapping[str, str], on_cpu: bool) -> int | None:
    """The pause to give NIXL's progress thread, or None to leave NIXL's default."""
    value = env.get(PAUSE_ENV, "")
    if not value.strip():
        return CPU_PAUSE_US if on_cpu else None
    try:
        return parse_pause_us(value)
    except ValueError as exc:  # set in the shell, past the schema's check
        raise SystemExit(str(exc)) from None


class PausedProgressBindings(types.ModuleType):
    """NIXL's bindings module as nixl._api sees it, except that the agents it makes pause `pause_us` between
    progress polls (nixl._api sets the delay on the agent's config right before it makes the agent)."""

    def __init__(self, bindings: types.ModuleType, pause_us: int):
        super().__init__(bindings.__name__, bindings.__doc__)
        self.bindings, self.pause_us = bindings, pause_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - the bindings' name
        config.pthrDelay = self.pause_us
        return self.bindings.nixlAgent(name, config)


def pause_progress(api: types.ModuleType, pause_us: int) -> None:
    """NIXL agents made through `api` (nixl._api) from now on pause between progress polls."""
    bindings = api.nixlBind
    if isinstance(bindings, PausedProgressBindings):
        bindings = bindings.bindings
    api.nixlBind = PausedProgressBindings(bindings, pause_us)


def apply_progress_pause(env: Mapping[str, str], where: str) -> int | None:
    """Gives NIXL's progress thread its pause in this process, and says so; the pause, or None if unchanged."""
    from vllm.platforms import current_platform  # what vLLM itself runs on here

    pause_us = progress_pause_us(env, current_platform.is_cpu())
    if pause_us is None:
        return None
    try:
        from nixl import _api  # only where vLLM will start NIXL: it may be absent
    except ImportError:  # no NIXL: the connector fails at start with vLLM's own message
        return None
    pause_progress(_api, pause_us)
    print(
        f"flagscale: NIXL's progress thread pauses {pause_us} us between polls ({where})", file=sys.stderr, flush=True
    )
    return pause_us


def light_progress_reservation(env: Mapping[str, str], pause_us: int | None) -> int | None:
    """The cores vLLM's automatic CPU binding should keep from the workers when NIXL's progress thread pauses,
    or None to leave vLLM's own choice: the thread busy or NIXL's default, the binding set by hand, or the
    reservation given. Automatic binding is a one-rank replica's (the orchestrator binds the ranks of larger ones
    itself, core by core), for which vLLM keeps one core without a connector."""
    if not pause_us or env.get(RESERVED_ENV, "").strip() or env.get(BIND_ENV, "auto").strip() != "auto":
        return None
    return 1


def main(argv: list[str]) -> None:
    pause_us = apply_progress_pause(os.environ, "the API server")
    reserved = light_progress_reservation(os.environ, pause_us)
    if reserved is not None:  # inherited by the engine core vLLM spawns, which binds the workers
        os.environ[RESERVED_ENV] = str(reserved)
        print(
            f"flagscale: vLLM's CPU binding keeps {reserved} core(s) from the workers, as without a KV connector "
            "(NIXL's progress thread pauses)",
            file=sys.stderr,
            flush=True,
        )
    sys.argv = [SERVER_MODULE, *argv]
    # not alter_sys: this module stays __main__, so that what vLLM spawns imports it (below)
    runpy.run_module(SERVER_MODULE, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
elif __name__ == "__mp_main__":  # a process vLLM spawned from the server: its engine core, and the core's workers
    apply_progress_pause(os.environ, f"pid {os.getpid()}, spawned by vLLM")
