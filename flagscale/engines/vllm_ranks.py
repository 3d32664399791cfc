"""vLLM ranks of one replica: the env and argv of each rank's process under vLLM's multiprocessing executor, and
which rank a worker process is by its title (flagscale/replica/ranks.py places them; docs/parallelism.md)."""

from __future__ import annotations

import re

from flagscale.engines.base import HostShare

# Ranks of one replica run under vLLM's multiprocessing executor, on one host or several (--nnodes): its Ray
# executor refuses CPU ("current platform cpu does not support ray") and is what users report broken under Ray
# Serve placement groups (docs/parallelism.md).
EXECUTOR_FLAG = "--distributed-executor-backend"
RANK_EXECUTOR = "mp"


def rank_env(share: HostShare) -> dict[str, str]:
    """What the ranks on one host need besides argv: their cores (CPU) or devices (GPU), and across hosts the
    address their collectives use (without GLOO_SOCKET_IFNAME gloo advertises 127.0.0.1 to the other host)."""
    env: dict[str, str] = {}
    if share.rank_cpus:  # vLLM's CPU workers: "cores of rank 0|cores of rank 1|..." by local rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cpus)) for cpus in share.rank_cpus)
    if share.gpus:
        env[share.visible_env] = ",".join(share.gpus)
    if share.nnodes > 1:
        env["VLLM_HOST_IP"] = share.host
        if share.interface:
            env["GLOO_SOCKET_IFNAME"] = share.interface
            if share.gpus:  # the devices' collective library (NCCL, HCCL, ...) on the same interface
                env.update(dict.fromkeys(share.interface_env, share.interface))
    return env


def rank_argv(argv: list[str], share: HostShare) -> list[str]:
    """`argv` plus the executor and, across hosts, this host's place in the rendezvous."""
    extra = [] if EXECUTOR_FLAG in argv else [EXECUTOR_FLAG, RANK_EXECUTOR]
    if share.nnodes > 1 and share.dp_local:  # vLLM's multi-node data parallel: whole DP ranks on each host
        assert share.master is not None, "data parallel over several hosts needs the DP master's address"
        address, port = share.master
        extra += ["--data-parallel-size-local", str(share.dp_local)]
        extra += ["--data-parallel-address", address, "--data-parallel-rpc-port", str(port)]
        if share.node_rank > 0:  # on the API server's host vLLM would take a start rank for its hybrid balancing
            extra += ["--data-parallel-start-rank", str(share.dp_start)]
    elif share.nnodes > 1:
        assert share.master is not None, "a replica over several hosts needs node rank 0's address"
        address, port = share.master
        extra += ["--nnodes", str(share.nnodes), "--node-rank", str(share.node_rank)]
        extra += ["--master-addr", address, "--master-port", str(port)]
    return [*argv, *extra]


# vLLM's worker process titles: VLLM::Worker[_DP<d>][_PP<p>][_TP<t>]... (multiproc_executor.py). The _DP part is
# there only when the workers share a data-parallel group (MoE models); a dense model's data-parallel engines run
# apart, each engine core titled VLLM::EngineCore_DP<d> over workers titled as if it were alone.
WORKER_TITLE = re.compile(r"^VLLM::Worker(?:_DP(\d+))?(?:_PP(\d+))?(?:_PCP\d+)?(?:_TP(\d+))?")
ENGINE_CORE_DP_TITLE = re.compile(r"^VLLM::EngineCore_DP(\d+)")


def rank_of_title(title: str, tp: int, pp: int, parent_title: str = "") -> int | None:
    """The global rank of a vLLM worker from its process title (and its engine core's, the parent), or None when
    it is no worker."""
    match = WORKER_TITLE.match(title)
    if not match:
        return None
    dp_rank, pp_rank, tp_rank = (int(g) if g else 0 for g in match.groups())
    engine_core = ENGINE_CORE_DP_TITLE.match(parent_title)
    if match.group(1) is None and engine_core:
        dp_rank = int(engine_core.group(1))
    return dp_rank * tp * pp + pp_rank * tp + tp_rank
