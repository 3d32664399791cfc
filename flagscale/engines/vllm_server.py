"""`python -m flagscale.engines.vllm_server <vllm serve args>`: vLLM's OpenAI server
(`vllm.entrypoints.openai.api_server`, unchanged) for a prefill or decode replica, with NIXL's progress thread off
where vLLM runs on CPU.

NIXL 1.5.1's Python API starts every agent with a progress thread that polls UCX with no pause between polls (it
sets the delay to 0), so each engine with a NixlConnector keeps one core busy for as long as it lives, idle or
not. vLLM has no option for it. On a GPU host that is a spare core buying shorter transfers; on a CPU host it is a
core taken from the engines' own compute. On a 2-core machine like CI's, with 2 prefill + 1 decode engines and
a colocated one, the 32 requests of tests/e2e/test_disaggregation.py's answers test took 112 s with the threads
and 7 s without (docs/disaggregation.md). Without the thread, UCX makes progress inside NIXL's own calls, which vLLM's
connector makes on every engine step; the KV still moves, and the e2e tests check that it does.

FLAGSCALE_NIXL_PROGRESS_THREAD (experiment.envs): `1` keeps the thread, `0` turns it off on GPUs too; unset, it
is off on CPU only. The NIXL agents live in the engine core (or its workers), which vLLM on CPU always spawns
(never forks): a spawned process imports its parent's `__main__` module again as `__mp_main__` before it runs, so
this module stays `__main__` while vLLM's server runs in it, and applies the same choice when imported so.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from collections.abc import Mapping
from typing import Any

PROGRESS_THREAD_ENV = "FLAGSCALE_NIXL_PROGRESS_THREAD"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def progress_thread_wanted(env: Mapping[str, str], on_cpu: bool) -> bool:
    value = env.get(PROGRESS_THREAD_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise SystemExit(f"{PROGRESS_THREAD_ENV}={value!r}: give 0 or 1, or leave it unset (off on CPU only)")
    return not on_cpu


def without_progress_thread(config_cls: Any) -> None:
    """NIXL agent configs made from now on default to no progress thread (one that asks for it keeps it)."""
    init = config_cls.__init__
    if getattr(init, "without_progress_thread", False):
        return

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:  # enable_prog_thread is the first positional parameter
            kwargs.setdefault("enable_prog_thread", False)
        init(self, *args, **kwargs)

    __init__.without_progress_thread = True  # type: ignore[attr-defined]
    config_cls.__init__ = __init__


def apply_progress_thread_choice(env: Mapping[str, str], where: str) -> bool:
    """Turns NIXL's progress thread off in this process unless wanted; True when it did (and says so)."""
    from vllm.platforms import current_platform  # what vLLM itself runs on here

    if progress_thread_wanted(env, current_platform.is_cpu()):
        return False
    try:
        from nixl._api import nixl_agent_config
    except ImportError:  # no NIXL: the connector fails at start with vLLM's own message
        return False
    without_progress_thread(nixl_agent_config)
    print(f"flagscale: NIXL agents start without their progress thread (CPU; {where})", file=sys.stderr, flush=True)
    return True


def main(argv: list[str]) -> None:
    apply_progress_thread_choice(os.environ, "the API server")
    sys.argv = [SERVER_MODULE, *argv]
    # not alter_sys: this module stays __main__, so that what vLLM spawns imports it (below)
    runpy.run_module(SERVER_MODULE, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
elif __name__ == "__mp_main__":  # a process vLLM spawned from the server: its engine core, and the core's workers
    apply_progress_thread_choice(os.environ, f"pid {os.getpid()}, spawned by vLLM")
