"""Where the run's Ray cluster comes from, one entry point for `run`: `cluster_kind` picks one of three from
experiment.runner, `launch_cluster` brings it up.

- "ssh": a hostfile's hosts are started over SSH (multihost.ClusterLauncher: head, workers, a CPU-less driver node
  here);
- "local": no hostfile, this machine alone, a one-host cluster whose head is started through the local runner
  (ray_node.start_local_head). Both start each node with ray_node.start_node through the host's CommandRunner and
  record its session in the state, which is all `stop` needs;
- "ray" (`runner.type: ray`): an existing Ray cluster (cluster/ray_cluster.py); nothing is started, the state
  records the address, and `stop` removes only the deployment.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flagscale.cluster.ray_env import worker_env
from flagscale.cluster.ray_node import start_local_head
from flagscale.cluster.state import RunState
from flagscale.devices import local_gpu_count

KINDS = ("local", "ssh", "ray")


def cluster_kind(runner, where: str) -> str:
    """ "local", "ssh" or "ray" from experiment.runner (`where`: the config file, for errors)."""
    from flagscale.errors import ConfigError

    if runner.type == "cloud":
        raise ConfigError(
            "runner.type: cloud (FlagScale's Kubernetes LeaderWorkerSet runner) is not supported; on Kubernetes, run "
            "a KubeRay RayCluster and deploy onto it with runner.type: ray and runner.address (docs/clusters.md)",
            f"{where}: experiment.runner.type",
        )
    if runner.type != "ray":
        if runner.address:
            raise ConfigError(
                "runner.address is the address of an existing Ray cluster: it needs runner.type: ray",
                f"{where}: experiment.runner.address",
            )
        return "ssh" if runner.hostfile else "local"
    if runner.hostfile:
        raise ConfigError(
            "runner.type: ray deploys onto a running Ray cluster; runner.hostfile names hosts to start one on. "
            "Set one of them",
            f"{where}: experiment.runner.hostfile",
        )
    for key in ("ray_port", "num_cpus", "head"):
        if getattr(runner, key) is not None:
            raise ConfigError(
                f"runner.{key} sets up a Ray node this runner starts; with runner.type: ray the cluster's own "
                "nodes are used as they are",
                f"{where}: experiment.runner.{key}",
            )
    return "ray"


def launch_cluster(state: RunState, plan, console: Console) -> str:
    """Start every Ray node of the plan's target (none on an existing Ray cluster); returns a line saying what is
    up."""
    if plan.ray_cluster is not None:
        facts = plan.ray_cluster
        state.ray_address = facts.address
        state.extra["cluster"] = "ray"
        state.save()
        return (
            f"using the Ray cluster at {facts.address}: {len(facts.nodes)} node(s), the router on {facts.head.ip} "
            "(nothing started)"
        )
    if plan.cluster is not None:
        from flagscale.cluster.multihost import ClusterLauncher

        hosts = len(plan.cluster.hostfile.hosts)
        with console.status(f"starting Ray on {hosts} host(s) over SSH ..."):
            common_env = {k: v for k, v in worker_env(plan.envs).items() if k not in plan.envs}  # envs go per host
            ClusterLauncher(state, plan, common_env).start(console)
        return f"Ray cluster up: head {state.ray_address}, {hosts} host(s) joined"
    with console.status("starting a local Ray head ..."):
        start_local_head(
            state,
            num_cpus=plan.head_num_cpus,
            num_gpus=local_gpu_count() or None,
            envs=worker_env(plan.envs),
            before_start=plan.before_start,
            log_path=plan.log_dir / "ray-head.log",
            port=plan.ray_port,
        )
    _link_ray_logs(state, plan.log_dir)
    return f"Ray head up at {state.ray_address}"


def _link_ray_logs(state: RunState, log_dir: Path) -> None:
    """serve_logs/ray -> the head's Ray session logs (this machine's)."""
    head = state.hosts[0]
    link = log_dir / "ray"
    if head.temp_dir and not link.exists():
        try:
            link.symlink_to(Path(head.temp_dir) / "session_latest" / "logs")
        except OSError:
            pass
