"""Starting the run's Ray cluster on its target, one entry point for `run`.

A hostfile's hosts are started over SSH (multihost.ClusterLauncher: head, workers, a CPU-less driver node here);
without a hostfile the target is this machine alone, a one-host cluster whose head is started through the local
runner (ray_node.start_local_head). Both start each node with ray_node.start_node through the host's
CommandRunner and record its session in the state, which is all `stop` needs.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flagscale.cluster.ray_env import worker_env
from flagscale.cluster.ray_node import start_local_head
from flagscale.cluster.state import RunState
from flagscale.devices import local_gpu_count


def launch_cluster(state: RunState, plan, console: Console) -> str:
    """Start every Ray node of the plan's target; returns a line saying what is up."""
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
