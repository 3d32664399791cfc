"""`flagscale serve|run ...` -> the Hydra command line of one config: pure logic, no I/O beyond looking at files.

FlagScale's flags become this project's keys (docs/config.md): `--port` is the endpoint's port
(`experiment.runner.deploy.port`), `--model-path` and `--engine-args` go to the first node's `engine_args`
(`serve.0.engine_args.*`, the node FlagScale's flags apply to)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from flagscale.actions import ACTIONS
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.errors import ConfigError

# `flagscale serve` flag -> action; no flag: run.
SERVE_ACTIONS = {
    "stop": "stop",
    "test": "test",
    "tune": "auto_tune",
    "status": "status",
    "logs": "logs",
    "dryrun": "dryrun",
    "bench": "bench",
}
ACTION_NAMES = tuple(ACTIONS)
FIRST_NODE_ARGS = "serve.0.engine_args"
PORT_KEY = "experiment.runner.deploy.port"


@dataclass(frozen=True)
class HydraCall:
    """One config (`config_dir/config_name.yaml`) and the overrides to apply to it."""

    config_dir: Path
    config_name: str
    overrides: list[str] = field(default_factory=list)
    invocation: Invocation = RUN_PY  # the same deployment's other actions, in the form the user typed

    def argv(self) -> list[str]:
        return ["--config-path", str(self.config_dir), "--config-name", self.config_name, *self.overrides]


def is_override(word: str) -> bool:
    return "=" in word or word.startswith("~")


def hydra_value(value) -> str:
    """A JSON value in Hydra's override syntax (strings quoted, so `/`, `:`, spaces and `=` stay literal)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    # Hydra reads a backslash literally unless it precedes a quote or ends the string: only those runs are doubled.
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value)).replace("'", "\\'")
    return f"'{text}'"


def engine_args_overrides(text: str) -> list[str]:
    """`--engine-args '{"max_model_len": 4096, "compilation_config": {"level": 3}}'` -> one override per leaf."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON ({exc.msg} at column {exc.colno}): {text}", "--engine-args") from None
    if not isinstance(args, dict):
        raise ConfigError(f"expected a JSON object such as '{{\"max_model_len\": 4096}}', got: {text}", "--engine-args")
    return _flatten(FIRST_NODE_ARGS, args)


def _flatten(prefix: str, args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        if isinstance(value, dict) and value:
            out += _flatten(f"{prefix}.{key}", value)
        else:
            out.append(f"{prefix}.{key}={hydra_value(value)}")
    return out


def config_file(given: str, what: str) -> tuple[Path, str]:
    """A YAML file (or a directory holding conf/serve.yaml or serve.yaml) -> (config dir, config name)."""
    path = Path(given).expanduser()
    if path.is_dir():
        for candidate in (path / "conf" / "serve.yaml", path / "serve.yaml"):
            if candidate.is_file():
                return candidate.parent.resolve(), "serve"
        raise ConfigError("directory has neither conf/serve.yaml nor serve.yaml", f"{what} {given}")
    if not path.is_file():
        raise ConfigError("no such config file", f"{what} {given}")
    if path.suffix != ".yaml":
        raise ConfigError("a config file must end in .yaml (Hydra reads no other)", f"{what} {given}")
    return path.resolve().parent, path.stem


def looks_like_path(target: str) -> bool:
    return target.endswith((".yaml", ".yml")) or "/" in target or target in (".", "..")


def serve_config(target: str | None, config: str | None, conf_dir: Path, examples_dir: Path) -> tuple[Path, str]:
    """Which config `flagscale serve [target] [-c config]` means: -c's file; a path; `demo` (the embedded default,
    conf/serve.yaml); otherwise examples/<target>/conf/serve.yaml."""
    if config:
        return config_file(config, "--config")
    if target is None:
        raise ConfigError("name a model (demo, an example's name) or a config file, or pass -c/--config", "serve")
    if looks_like_path(target):
        return config_file(target, "serve")
    if target == "demo":
        return conf_dir, "serve"
    example = examples_dir / target / "conf" / "serve.yaml"
    if example.is_file():
        return example.parent, "serve"
    if Path(target).is_file():
        return config_file(target, "serve")
    known = ", ".join(["demo", *sorted(p.parent.parent.name for p in examples_dir.glob("*/conf/serve.yaml"))])
    raise ConfigError(f"no example of that name ({example} does not exist); known: {known}", f"serve {target}")


def serve_call(
    words: list[str],
    *,
    config: str | None = None,
    action: str | None = None,
    port: int | None = None,
    model_path: str | None = None,
    engine_args: str | None = None,
    conf_dir: Path,
    examples_dir: Path,
) -> HydraCall:
    """`flagscale serve` -> HydraCall. `words`: the model or config path first (optional with -c), then overrides."""
    target = words[0] if words and not is_override(words[0]) else None
    extra = words[1:] if target is not None else list(words)
    _check_overrides(extra)
    config_dir, name = serve_config(target, config, conf_dir, examples_dir)
    overrides = [f"action={SERVE_ACTIONS[action] if action else 'run'}"]
    if port is not None:
        overrides.append(f"{PORT_KEY}={port}")
    if model_path is not None:
        local = Path(model_path).expanduser()
        overrides.append(
            f"{FIRST_NODE_ARGS}.model={hydra_value(str(local.resolve()) if local.exists() else model_path)}"
        )
    if engine_args is not None:
        overrides += engine_args_overrides(engine_args)
    return HydraCall(config_dir, name, overrides + extra, serve_invocation(target, config, extra))


def serve_invocation(target: str | None, config: str | None, extra: list[str]) -> Invocation:
    """`flagscale serve MODEL [-c YAML] [overrides]` and an action flag: what names the deployment, without the
    flags that only shape a start (--port, --model-path, --engine-args)."""
    words = ["flagscale", "serve", *([target] if target else []), *(["-c", config] if config else []), *extra]
    flags = {action: f"--{flag}" for flag, action in SERVE_ACTIONS.items()}
    return Invocation(shlex.join(words), {**flags, "run": ""})


def run_call(config_dir: str, name: str, action: str | None, extra: list[str]) -> HydraCall:
    """`flagscale run -p DIR -n NAME [-a ACTION] [overrides]` -> HydraCall (the config's own `action:` without -a)."""
    _check_overrides(extra)
    name = name.removesuffix(".yaml")
    directory = Path(config_dir).expanduser()
    if not directory.is_dir():
        raise ConfigError("no such directory", f"-p {config_dir}")
    if not (directory / f"{name}.yaml").is_file():
        raise ConfigError(f"no {name}.yaml in {directory}", f"-n {name}")
    overrides = [f"action={action}"] if action else []
    words = ["flagscale", "run", "-p", config_dir, *(["-n", name] if name != "serve" else []), *extra]
    invocation = Invocation(shlex.join(words), {a: f"-a {a}" for a in ACTION_NAMES})
    return HydraCall(directory.resolve(), name, overrides + list(extra), invocation)


def _check_overrides(words: list[str]) -> None:
    for word in words:
        if not is_override(word):
            raise ConfigError(
                "unexpected argument: overrides are key=value (e.g. experiment.runner.deploy.port=9000)", word
            )
