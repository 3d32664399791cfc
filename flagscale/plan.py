"""From the validated config to a plan: engine nodes, replicas, resources, argv, endpoint. `dryrun` prints it.

Every check that needs more than the schema (engine args via vLLM, model paths, names, devices, port) runs
here, before anything is started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flagscale.cluster.placement import ClusterPlan, endpoint_in_use, load_hostfile, place_engine, plan_cluster
from flagscale.config.engine_args import to_argv
from flagscale.config.graph import CustomNodePlan, GraphPlan, build_graph_plan
from flagscale.config.load import ConfigSources
from flagscale.config.replicas import ReplicaSettings, replica_settings
from flagscale.config.schema import NodeConfig, ServeConfig
from flagscale.errors import ConfigError

DEFAULT_PORT = 8000
ROUTER_DEPLOYMENT = "router"


@dataclass
class EnginePlan(ReplicaSettings):
    serve_id: str
    model: str
    model_names: list[str]
    argv: list[str]
    device: str  # "cpu" or "gpu"
    devices_per_replica: int
    chip: str | None = None  # hostfile chip type the replicas run on (multi-host)
    placement_bundles: list[dict[str, float]] | None = None  # set when TP x PP spans hosts
    placement_strategy: str | None = None


@dataclass
class Plan:
    app_name: str
    exp_dir: str
    host: str
    port: int
    engines: list[EnginePlan]
    head_num_cpus: int
    envs: dict[str, str]
    before_start: str | None
    startup_timeout_s: float
    schedule_timeout_s: float
    drain_timeout_s: float
    pin_cpus: bool = True  # deploy.cpu_affinity == "auto"
    notes: list[str] = field(default_factory=list)
    graph: GraphPlan | None = None  # custom nodes and the graph's HTTP entry, when the config has any
    cluster: ClusterPlan | None = None  # hosts of the hostfile, when runner.hostfile is set

    @property
    def model_ids(self) -> list[str]:
        return [name for engine in self.engines for name in engine.model_names]

    @property
    def endpoint(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def state_path(self) -> Path:
        return Path(self.exp_dir) / "state.json"

    @property
    def log_dir(self) -> Path:
        return Path(self.exp_dir) / "serve_logs"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _check_model(model: Any, where: str) -> str:
    if not isinstance(model, str) or not model:
        raise ConfigError("engine_args.model is required (a local model directory or a Hugging Face id)", where)
    path = Path(os.path.expanduser(model))
    looks_like_path = model.startswith(("/", ".", "~")) or path.exists()
    if looks_like_path:
        if not path.is_dir():
            raise ConfigError(f"model path {model!r} does not exist or is not a directory", where)
        if not (path / "config.json").exists():
            raise ConfigError(f"model path {model!r} has no config.json (not a Hugging Face model dir)", where)
        return str(path.resolve())
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model, "config.json"), str):
            raise ConfigError(f"model {model!r} is not a local directory and not in the offline HF cache", where)
    return model


def _engine_plan(node: NodeConfig, index: int, gpus: int, sources: ConfigSources, on_hosts: bool = False) -> EnginePlan:
    """on_hosts: a hostfile gives the devices (checked by cluster.placement), not this machine."""
    where = f"{sources.file_for(('serve',))}: serve[{index}]({node.serve_id}).engine_args"
    args = dict(node.engine_args)
    args["model"] = _check_model(args.get("model"), where)
    names = args.get("served_model_name") or [node.serve_id]
    names = [names] if isinstance(names, str) else list(names)
    args["served_model_name"] = names
    argv = to_argv(args, where)

    def size(key: str) -> int:
        value = args.get(key, 1)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}", where)
        return value

    tp, pp, dp = size("tensor_parallel_size"), size("pipeline_parallel_size"), size("data_parallel_size")
    devices = tp * pp * dp
    res = node.resources
    res_where = f"{sources.file_for(('serve',))}: serve[{index}]({node.serve_id}).resources"
    if not on_hosts and res.num_gpus and res.num_gpus > 0 and gpus == 0:
        raise ConfigError(f"num_gpus={res.num_gpus} per replica, but this machine has no GPU", res_where)
    on_gpu = (res.num_gpus or 0) > 0 or (res.num_gpus is None and gpus > 0)
    if on_gpu:
        offered, kind = gpus, "GPU"
    else:
        offered, kind = os.cpu_count() or 1, "CPU"
    if not on_hosts and devices > offered:
        raise ConfigError(
            f"TP x PP x DP = {tp} x {pp} x {dp} = {devices} {kind} devices per replica, "
            f"but this machine offers {offered}",
            where,
        )
    replicas = replica_settings(res, default_cpus=1 if on_gpu else devices, default_gpus=devices if on_gpu else 0)
    return EnginePlan(
        serve_id=node.serve_id,
        model=args["model"],
        model_names=names,
        argv=argv,
        device="gpu" if on_gpu else "cpu",
        devices_per_replica=devices,
        **vars(replicas),
    )


def _cpu_sum(engines: list[EnginePlan | CustomNodePlan]) -> str:
    return " + ".join(f"{e.serve_id}: {e.initial_replicas} x {e.ray_actor_options['num_cpus']:g}" for e in engines)


def build_plan(config: ServeConfig, sources: ConfigSources = ConfigSources(), check_port: bool = True) -> Plan:
    serve_file = sources.file_for(("serve",))
    seen_ids: dict[str, int] = {}
    seen_names: dict[str, str] = {}
    engines: list[EnginePlan] = []
    gpus = local_gpu_count()
    hostfile = load_hostfile(config, sources)
    on_hosts: list[tuple[EnginePlan, NodeConfig]] = []
    for index, node in enumerate(config.serve):
        if node.serve_id in seen_ids:
            raise ConfigError(
                f"duplicate serve_id '{node.serve_id}' (also serve[{seen_ids[node.serve_id]}])", f"{serve_file}: serve[{index}]"
            )
        seen_ids[node.serve_id] = index
        if not node.is_engine:
            continue  # custom nodes: build_graph_plan below
        engine = _engine_plan(node, index, gpus, sources, on_hosts=hostfile is not None)
        if hostfile is not None:
            place_engine(engine, node, hostfile, config.experiment.runner.placement_strategy,
                         f"{serve_file}: serve[{index}]({node.serve_id}).resources")  # fmt: skip
            on_hosts.append((engine, node))
        for name in engine.model_names:
            if name in seen_names:
                raise ConfigError(
                    f"served model name '{name}' is used by both '{seen_names[name]}' and '{node.serve_id}'",
                    f"{serve_file}: serve[{index}]({node.serve_id})",
                )
            seen_names[name] = node.serve_id
        engines.append(engine)

    runner = config.experiment.runner
    deploy = runner.deploy
    port = deploy.port
    if port is None:
        port = next((n.engine_args["port"] for n in config.serve if isinstance(n.engine_args.get("port"), int)), DEFAULT_PORT)
    if check_port and hostfile is not None and endpoint_in_use(deploy.host, port):
        raise ConfigError(f"port {port} on {deploy.host} is already in use", f"{sources.main}: experiment.runner.deploy.port")
    if check_port and hostfile is None and not port_is_free(deploy.host, port):
        raise ConfigError(f"port {port} on {deploy.host} is already in use", f"{sources.main}: experiment.runner.deploy.port")

    graph = build_graph_plan(config, sources, {e.serve_id: e.model_names[0] for e in engines})
    replica_groups = [*engines, *(graph.nodes if graph else [])]
    required_cpus = sum(e.initial_replicas * e.ray_actor_options["num_cpus"] for e in replica_groups)
    required = int(-(-required_cpus // 1))
    cluster = plan_cluster(config, sources, hostfile, on_hosts) if hostfile is not None else None
    if runner.num_cpus is not None and cluster is None:
        if runner.num_cpus < required:
            raise ConfigError(
                f"num_cpus={runner.num_cpus}, but the graph's replicas reserve {required_cpus:g} CPUs "
                f"({_cpu_sum(replica_groups)})",
                f"{sources.main}: experiment.runner.num_cpus",
            )
        head_cpus = runner.num_cpus
    else:
        head_cpus = max(os.cpu_count() or 1, required)
    notes = []
    if cluster is None and required > (os.cpu_count() or 1):
        notes.append(f"replicas reserve {required} logical CPUs on a {os.cpu_count()}-core machine: oversubscribed")

    exp_dir = str(Path(config.experiment.exp_dir).expanduser().resolve())
    return Plan(
        app_name=config.experiment.exp_name,
        exp_dir=exp_dir,
        host=deploy.host,
        port=port,
        engines=engines,
        head_num_cpus=head_cpus,
        envs=config.experiment.env_for(),
        before_start=config.experiment.cmds.before_start,
        startup_timeout_s=deploy.startup_timeout_s,
        schedule_timeout_s=deploy.schedule_timeout_s,
        drain_timeout_s=deploy.drain_timeout_s,
        pin_cpus=deploy.cpu_affinity == "auto",
        notes=notes,
        graph=graph,
        cluster=cluster,
    )
