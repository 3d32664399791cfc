"""`flagscale`: FlagScale v1.0's command line over the same Hydra entry as run.py.

flagscale serve <model|path.yaml> [-c YAML] [--stop|--test|--tune|--status|--logs|--dryrun|--bench]
                [--port N] [--model-path P] [--engine-args JSON] [key=value ...]
flagscale run -p DIR -n NAME [-a ACTION] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from flagscale.actions import ACTIONS
from flagscale.cli import argv as cli_argv
from flagscale.cli.resources import conf_dir, example_names, examples_dir
from flagscale.errors import FlagScaleError
from flagscale.secrets import mask_argv

# serve's action flags (FlagScale v1.0's names) and their help: the action registry's one-line summaries
ACTION_HELP = {flag: ACTIONS[action].summary for flag, action in cli_argv.SERVE_ACTIONS.items()}
RUN_ACTIONS = tuple(ACTIONS)


def _version() -> str:
    try:
        return metadata.version("flagscale")
    except metadata.PackageNotFoundError:  # run from a checkout that was not installed
        return "checkout"


def _serve_parser(sub) -> argparse.ArgumentParser:
    names = ", ".join(["demo", *example_names()])
    parser = sub.add_parser(
        "serve",
        help="serve a model: the demo, an example by name, or a config file (default action: run)",
        description="Serve the embedded demo, examples/<name>/conf/serve.yaml, or a config file; "
        "without an action flag it starts the deployment and returns.",
        epilog=f"models: {names}. Extra key=value arguments are Hydra overrides of the config.",
    )
    parser.add_argument(
        "words",
        nargs="*",
        metavar="MODEL",
        help="demo, an example's name, or a config (.yaml, or a directory with conf/serve.yaml); "
        "then key=value Hydra overrides",
    )
    parser.add_argument("-c", "--config", metavar="YAML", help="this config file instead of the model's own")
    actions = parser.add_argument_group("actions (one at most; none: run)").add_mutually_exclusive_group()
    for flag, text in ACTION_HELP.items():
        actions.add_argument(f"--{flag}", dest="action", action="store_const", const=flag, help=text)
    parser.add_argument("--port", type=int, help=f"endpoint port ({cli_argv.PORT_KEY})")
    parser.add_argument("--model-path", metavar="P", help=f"model directory or id ({cli_argv.FIRST_NODE_ARGS}.model)")
    parser.add_argument(
        "--engine-args", metavar="JSON", help=f"engine arguments as a JSON object ({cli_argv.FIRST_NODE_ARGS}.*)"
    )
    return parser


def _run_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "run",
        help="run any action of any config: -p DIR -n NAME -a ACTION [key=value ...]",
        description="Run DIR/NAME.yaml (FlagScale's `flagscale run`); the same as "
        "`python run.py --config-path DIR --config-name NAME action=ACTION ...`.",
    )
    parser.add_argument("-p", "--config-path", required=True, metavar="DIR", help="the config's directory")
    parser.add_argument(
        "-n", "--config-name", default="serve", metavar="NAME", help="the config's name (default serve)"
    )
    parser.add_argument("-a", "--action", choices=RUN_ACTIONS, help="default: the config's own `action:`")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides")
    return parser


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="flagscale",
        description="FlagScale-compatible LLM serving: one YAML -> Ray cluster -> Ray Serve -> engines.",
        epilog="flagscale serve demo  # the embedded demo model on http://127.0.0.1:8000/v1",
    )
    parser.add_argument("-v", "--version", action="version", version=f"flagscale {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,run}")
    return parser, {"serve": _serve_parser(sub), "run": _run_parser(sub)}


def hydra_call(argv: list[str]) -> cli_argv.HydraCall:
    """Parse `argv` (without the program name) into the HydraCall it means; argparse exits on bad flags."""
    parser, commands = build_parser()
    if not argv or argv[0] not in commands:
        parser.parse_args(argv or ["--help"])  # --help, --version, or argparse's own error for a bad command
        parser.error(f"unknown command {argv[0]!r}")
    command, rest = argv[0], argv[1:]
    # intermixed: overrides may come before or after the flags
    args = commands[command].parse_intermixed_args(rest)
    if command == "run":
        return cli_argv.run_call(args.config_path, args.config_name, args.action, args.overrides)
    return cli_argv.serve_call(
        args.words,
        config=args.config,
        action=args.action,
        port=args.port,
        model_path=args.model_path,
        engine_args=args.engine_args,
        conf_dir=conf_dir(),
        examples_dir=examples_dir(),
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        call = hydra_call(argv)
    except FlagScaleError as exc:
        print(f"flagscale: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    print(
        f"flagscale: {call.config_dir / call.config_name}.yaml {' '.join(mask_argv(call.overrides))}", file=sys.stderr
    )
    # reason: Hydra, Ray and the actions load only once the command line is known to be good (fast --help and errors)
    from flagscale.cli.hydra_entry import main as hydra_main

    hydra_main(call.argv(), invocation=call.invocation)
