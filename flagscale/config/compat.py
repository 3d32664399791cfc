"""FlagScale's config generations (its main-legacy line and its v1.0 line) mapped onto the one schema.

Two steps, around the schema's single validation:
- `normalize` rewrites the raw tree before validation: old places and spellings move to where the schema
  has them, and each node without `engine`/`module` gets its engine from `experiment.task.backend`.
- `ignored` reads the validated config back: what was set but means nothing here (launcher keys, engine
  host/port, an auto_tuner block outside action=auto_tune, PD keys while disaggregation is off).
Every rewrite and every ignored key becomes a notice that `run` and `dryrun` print; nothing is silent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from flagscale import engines
from flagscale.config.schema import DeployConfig, ServeConfig
from flagscale.engines import DEFAULT_ENGINE, ENGINES, EngineKind
from flagscale.errors import ConfigError

# Env vars of FlagScale's own communication library; passed on like any env var, but nothing here reads them.
FLAGCX_ENV_PREFIXES = ("FLAGCX_", "USE_FLAGCX")
# The deploy keys that mean something only with prefill_decode_disaggregation on.
PD_KEYS = tuple(name for name in DeployConfig.model_fields if name.startswith(("prefill_", "decode_")))


def normalize(data: dict[str, Any], main_file: str, serve_file: str) -> list[str]:
    """Rewrite FlagScale's older layouts in `data` in place; one notice per rewrite."""
    notices: list[str] = []
    experiment = data.get("experiment")
    if isinstance(experiment, dict):
        runner = experiment.get("runner")
        if runner is None:
            runner = experiment["runner"] = {}
        if "deploy" in experiment and isinstance(runner, dict):
            if "deploy" in runner:
                raise ConfigError(
                    "both experiment.deploy (FlagScale's older place) and experiment.runner.deploy are set; keep one",
                    f"{main_file}: experiment",
                )
            runner["deploy"] = experiment.pop("deploy")
            notices.append("experiment.deploy (FlagScale's older place) is read as experiment.runner.deploy")
        deploy = runner.get("deploy") if isinstance(runner, dict) else None
        if isinstance(deploy, dict) and "use_fs_server" in deploy:
            if "use_fs_serve" in deploy:
                raise ConfigError(
                    "both use_fs_server and use_fs_serve are set; keep use_fs_serve",
                    f"{main_file}: experiment.runner.deploy",
                )
            deploy["use_fs_serve"] = deploy.pop("use_fs_server")
            notices.append("deploy.use_fs_server (the spelling in FlagScale's slides) is read as use_fs_serve")
    backend = _get(data, "experiment", "task", "backend")
    for index, node in enumerate(data.get("serve") or []):
        if not isinstance(node, dict):
            continue
        for args in (node.get("engine_args"), *((node.get("engine_args_specific") or {}).values())):
            if isinstance(args, dict):
                for key in [k for k in args if isinstance(k, str) and "-" in k]:
                    args[key.replace("-", "_")] = args.pop(key)
        if node.get("engine") is None and node.get("module") is None:
            if backend == "native":
                raise ConfigError(
                    "this node has neither `module` nor `engine`; under experiment.task.backend native every node "
                    f"is a custom node (module + name), or names its engine (`engine: {DEFAULT_ENGINE}`)",
                    f"{serve_file}: serve[{index}]({node.get('serve_id', '?')})",
                )
            node["engine"] = backend if backend in ENGINES else DEFAULT_ENGINE
    return notices


def ignored(config: ServeConfig) -> list[str]:
    """Notices for what the validated config sets but this project does not use."""
    notices = []
    keys = [f"{path} ({why})" for path, why in _ignored_fields(config, "")]
    if keys:
        notices.append("ignored FlagScale launcher keys: " + "; ".join(keys))
    flagcx = sorted(k for k in config.experiment.envs if k.startswith(FLAGCX_ENV_PREFIXES))
    if flagcx:
        notices.append(
            f"envs {', '.join(flagcx)} are passed on, but nothing here uses FlagCX "
            "(engines communicate through their own backends)"
        )
    for node in config.serve:
        others = sorted(e for e in node.engine_args_specific if e != node.engine)
        if others:
            notices.append(
                f"serve '{node.serve_id}': engine_args_specific.{', '.join(others)} ignored "
                f"(the node's engine is {node.engine or 'a custom node'})"
            )
    notices += _managed_engine_args(config)
    notices += _engine_ignored_args(config)
    if config.experiment.auto_tuner is not None and config.action not in ("auto_tune", "dryrun"):
        notices.append(
            f"experiment.auto_tuner ignored: only action=auto_tune (and dryrun) reads it (action is {config.action})"
        )
    deploy = config.experiment.runner.deploy
    pd_set = [key for key in PD_KEYS if key in deploy.model_fields_set and key != "prefill_decode_disaggregation"]
    if pd_set and not deploy.prefill_decode_disaggregation:
        notices.append(f"experiment.runner.deploy.{', '.join(pd_set)} ignored: prefill_decode_disaggregation is off")
    return notices


def _engine_ignored_args(config: ServeConfig) -> list[str]:
    """Engine args the node's engine drops (its kind's ignored_args: another engine's keys), each with why."""
    notices = []
    for node in config.serve:
        if not node.is_engine:
            continue
        kind = engines.get(node.engine)
        args = {**config.experiment.runner.cli_args, **node.merged_engine_args()}
        dropped = [f"{key} ({why})" for key, why in kind.ignored_args.items() if key in args]
        if dropped:
            notices.append(f"serve '{node.serve_id}': engine_args ignored by {kind.display}: " + "; ".join(dropped))
    return notices


def _managed_engine_args(config: ServeConfig) -> list[str]:
    """engine_args host/port: the orchestrator gives every replica its own; clients use the router's endpoint."""
    notices = []
    deploy = config.experiment.runner.deploy
    endpoint_port_taken = deploy.port is not None
    cli_args = config.experiment.runner.cli_args
    for node in config.serve:
        if not node.is_engine:
            continue
        args = {**cli_args, **node.merged_engine_args()}
        managed = [key for key in engines.get(node.engine).address_args if key in args]
        if not managed:
            continue
        notice = (
            f"serve '{node.serve_id}': engine_args {'/'.join(managed)} not passed to the engine: the orchestrator "
            "gives each replica its own; the endpoint is experiment.runner.deploy.host/port"
        )
        # FlagScale's meaning of the first engine's port: the port clients use (facts.endpoint_port does the same).
        if not endpoint_port_taken and isinstance(args.get("port"), int):
            notice += f" (deploy.port is unset, so the endpoint's port is this {args['port']})"
            endpoint_port_taken = True
        notices.append(notice)
    for host, extra in config.experiment.node_args.items():
        managed = [key for key in EngineKind.address_args if key in extra.engine_args]  # node_args reach every kind
        if managed:
            notices.append(
                f"experiment.node_args.{host}.engine_args {'/'.join(managed)} not passed to the engine: the "
                "orchestrator gives each replica its own; the endpoint is experiment.runner.deploy.host/port"
            )
    return notices


def _ignored_fields(model: BaseModel, prefix: str) -> list[tuple[str, str]]:
    found = []
    for name in sorted(model.model_fields_set):
        value = getattr(model, name)
        extra = type(model).model_fields[name].json_schema_extra
        path = f"{prefix}{name}"
        if isinstance(extra, dict) and "ignored_because" in extra and value is not None:
            found.append((path, str(extra["ignored_because"])))
        elif isinstance(value, BaseModel):
            found += _ignored_fields(value, path + ".")
    return found


def ignored_key_reasons() -> dict[str, str]:
    """Every launcher-only key the schema accepts -> why it is ignored (for docs/config.md)."""
    reasons: dict[str, str] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "ignored_because" in extra:
                reasons[prefix + name] = str(extra["ignored_because"])
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")

    walk(ServeConfig, "")
    return reasons


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


# How each FlagScale serve key is handled here, for the FlagScale column of docs/config.md. Keys declared with
# `launcher_key` in the schema are "ignored, with a notice" and need no entry; a key of this project that
# FlagScale lacks has none either.
FLAGSCALE_KEYS: dict[str, str] = {
    "action": "used; `test` too; `auto_tune` searches the auto_tuner space (docs/auto-tune.md)",
    "experiment.exp_name": "used",
    "experiment.exp_dir": "used",
    "experiment.task.type": "used",
    "experiment.task.backend": "mapped: the engine of nodes without `engine`/`module`",
    "experiment.task.entrypoint": "must be null",
    "experiment.runner.hostfile": "used",
    "experiment.runner.type": "`ssh` used; `cloud` refused (use `ray` with a KubeRay cluster)",
    "experiment.runner.ssh_port": "used",
    "experiment.runner.cli_args": "mapped: engine args of every engine node",
    "experiment.runner.deploy": "used; also read from `experiment.deploy` (notice)",
    "experiment.runner.deploy.port": "used",
    "experiment.runner.deploy.name": "used",
    "experiment.runner.deploy.request": "used, both forms",
    "experiment.runner.deploy.prefill_decode_disaggregation": "mapped: every engine node gets `disaggregation`",
    "experiment.runner.deploy.prefill_num": "mapped: disaggregation.prefill.resources.num_replicas (PD off: notice)",
    "experiment.runner.deploy.decode_num": "mapped: disaggregation.decode.resources.num_replicas (PD off: notice)",
    "experiment.runner.deploy.prefill_address": "mapped: disaggregation.prefill.host (PD off: notice)",
    "experiment.runner.deploy.decode_address": "mapped: disaggregation.decode.host (PD off: notice)",
    "experiment.runner.deploy.prefill_decode_strategy": "mapped: disaggregation.prefill_routing (PD off: notice)",
    "experiment.runner.deploy.decode_gpu_memory_utilization": "mapped: the decode pool's gpu_memory_utilization "
    "(PD off: notice)",
    "experiment.envs": "used; `envs.nodes_envs.<host>` too; FlagCX vars passed on (notice)",
    "experiment.cmds": "used",
    "experiment.cmds.before_start": "used",
    "experiment.cmds.after_stop": "used",
    "experiment.node_args": "used",
    "experiment.auto_tuner": "used by action=auto_tune (docs/auto-tune.md); dryrun lists its candidates; other "
    "actions ignore it (notice)",
    "experiment.auto_tuner.space": "used: both shapes (flat, and per engine with `engines`)",
    "experiment.auto_tuner.engines": "used",
    "experiment.auto_tuner.cards": "used: TP x PP x instance above it is skipped",
    "experiment.auto_tuner.control": "used",
    "experiment.auto_tuner.control.interval": "used: rest between trials",
    "experiment.auto_tuner.control.run_best": "used",
    "experiment.auto_tuner.control.max_time_per_task": "used",
    "experiment.auto_tuner.control.max_time": "used",
    "experiment.auto_tuner.performance": "used without an `slo`",
    "experiment.auto_tuner.performance.metric": "used; FlagScale's names too",
    "experiment.auto_tuner.performance.order": "used",
    "experiment.node_args.<host>.engine_args": "used",
    "serve[].serve_id": "used",
    "serve[].engine": f"used ({', '.join(f'`{name}`' for name in ENGINES)}; one that cannot serve here is refused "
    "before start)",
    "serve[].engine_args": "used; kebab-case keys too; host/port set per replica here (notice)",
    "serve[].engine_args_specific": "used for the node's engine; others ignored (notice)",
    "serve[].resources": "used",
    "serve[].module": "used",
    "serve[].name": "used",
    "serve[].depends": "used",
    "serve[].profile": "mapped: the default of action=bench for the node's model",
    **{
        f"serve[].resources.{key}": "used"
        for key in (
            "num_replicas",
            "min_replicas",
            "max_replicas",
            "target_ongoing_requests",
            "num_cpus",
            "num_gpus",
            "max_ongoing_requests",
            "upscale_delay_s",
            "downscale_delay_s",
        )
    },
    **{
        f"serve[].profile.{key}": "used"
        for key in ("prefix_len", "input_len", "output_len", "num_prompts", "range_ratio")
    },
}
