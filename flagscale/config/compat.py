"""FlagScale's config generations (its main-legacy line and its v1.0 line) mapped onto the one schema.

Two steps, around the schema's single validation:
- `normalize` rewrites the raw tree before validation: old places and spellings move to where the schema
  has them, and each node without `engine`/`module` gets its engine from `experiment.task.backend`.
- `ignored` reads the validated config back: the FlagScale keys that were set but mean nothing here.
Every rewrite and every ignored key becomes a notice that `run` and `dryrun` print; nothing is silent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from flagscale.config.schema import ServeConfig
from flagscale.errors import ConfigError

# Env vars of FlagScale's own communication library; passed on like any env var, but nothing here reads them.
FLAGCX_ENV_PREFIXES = ("FLAGCX_", "USE_FLAGCX")


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
                    "is a custom node (module + name), or names its engine (`engine: vllm`)",
                    f"{serve_file}: serve[{index}]({node.get('serve_id', '?')})",
                )
            node["engine"] = backend if backend in ("vllm", "sglang") else "vllm"
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
            "(engines communicate through vLLM's own backends)"
        )
    for node in config.serve:
        others = sorted(e for e in node.engine_args_specific if e != node.engine)
        if others:
            notices.append(
                f"serve '{node.serve_id}': engine_args_specific.{', '.join(others)} ignored "
                f"(the node's engine is {node.engine or 'a custom node'})"
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
    "action": "used; `test` too; `auto_tune` refused (not supported yet)",
    "experiment.exp_name": "used",
    "experiment.exp_dir": "used",
    "experiment.task.type": "used",
    "experiment.task.backend": "mapped: the engine of nodes without `engine`/`module`",
    "experiment.task.entrypoint": "must be null",
    "experiment.runner.hostfile": "used",
    "experiment.runner.ssh_port": "used",
    "experiment.runner.cli_args": "mapped: engine args of every engine node",
    "experiment.runner.deploy": "used; also read from `experiment.deploy` (notice)",
    "experiment.runner.deploy.port": "used",
    "experiment.runner.deploy.name": "used",
    "experiment.runner.deploy.request": "used, both forms",
    "experiment.runner.deploy.prefill_decode_disaggregation": "checked; `true` refused (not supported yet)",
    "experiment.runner.deploy.prefill_num": "checked",
    "experiment.runner.deploy.decode_num": "checked",
    "experiment.runner.deploy.prefill_address": "checked",
    "experiment.runner.deploy.decode_address": "checked",
    "experiment.runner.deploy.prefill_decode_strategy": "checked",
    "experiment.runner.deploy.decode_gpu_memory_utilization": "checked",
    "experiment.envs": "used; `envs.nodes_envs.<host>` too; FlagCX vars passed on (notice)",
    "experiment.cmds": "used",
    "experiment.cmds.before_start": "used",
    "experiment.cmds.after_stop": "used",
    "experiment.node_args": "used",
    "experiment.auto_tuner": "checked; action=auto_tune refused (not supported yet)",
    "experiment.node_args.<host>.engine_args": "used",
    "serve[].serve_id": "used",
    "serve[].engine": "used (`vllm`; `sglang` refused before start)",
    "serve[].engine_args": "used; kebab-case keys too",
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
