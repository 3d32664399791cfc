"""`action=bench`: load-test the running deployment with vLLM's own serving benchmark, one pass per concurrency.

The load generator, dataset and metric definitions are vLLM's (`vllm bench serve`: its Python entry
point, called with a Namespace from its own parser, in a worker process). This action picks the
arguments from `experiment.bench`, sends the load through the router, and writes a table,
<exp_dir>/bench/bench-<ts>.json and a plot next to it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flagscale.actions.context import ActionContext
from flagscale.adaptors import matplotlib_figure
from flagscale.cluster.state import RunState
from flagscale.config.schema import BenchConfig, NodeConfig, ServeConfig
from flagscale.engines.vllm_args import BENCH_MODULES, flexible_argument_parser, vllm_attr
from flagscale.errors import FlagScaleError
from flagscale.net import health_problem
from flagscale.plan import engine_args_of, served_names

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
CHAT_ENDPOINT = "/v1/chat/completions"
BENCH_KEY_ENV = "OPENAI_API_KEY"  # vLLM's benchmark sends it as the bearer token


def vllm_bench_argv(
    base_url: str, model: str, tokenizer: str, settings: BenchConfig, concurrency: int, num_warmups: int = 0
) -> list[str]:
    """Command-line arguments of `vllm bench serve` for one pass at `concurrency`."""
    argv = [
        "--backend",
        "openai-chat" if settings.endpoint == CHAT_ENDPOINT else "openai",
        "--base-url",
        base_url,
        "--endpoint",
        settings.endpoint,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--input-len",
        str(settings.input_len),
        "--output-len",
        str(settings.output_len),
        "--random-prefix-len",
        str(settings.prefix_len),
        "--random-range-ratio",
        f"{settings.range_ratio:g}",
        "--num-prompts",
        str(settings.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--num-warmups",
        str(num_warmups),
        "--seed",
        str(settings.seed),
        "--ignore-eos",
        "--percentile-metrics",
        ",".join(LATENCY_METRICS),
        "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--disable-tqdm",
        # Keeps the per-request `errors` in the returned dict (nothing is written to disk without --save-result).
        "--save-detailed",
    ]
    slos = [
        f"{name}:{value:g}"
        for name, value in (("ttft", settings.slo_ttft_ms), ("tpot", settings.slo_tpot_ms))
        if value is not None
    ]
    if slos:
        argv += ["--goodput", *slos]
    return argv


def run_vllm_bench(argv: list[str]) -> dict[str, Any]:
    """vLLM's serving benchmark, called in this process with a Namespace from its own parser."""

    add_cli_args, main = vllm_attr(BENCH_MODULES, "add_cli_args"), vllm_attr(BENCH_MODULES, "main")
    parser = flexible_argument_parser()()
    add_cli_args(parser)
    return main(parser.parse_args(argv))


def _log_to(log_path: str) -> None:
    # Worker side: fds 1 and 2, not just sys.stdout, so vLLM's logging and the exit-time noise of the
    # libraries it imports land in the log as well.
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def _prepare(log_path: str) -> int:
    """Worker side, once: vLLM's benchmark imported before the first pass (whose CPU and wall time would
    otherwise include it); the worker's pid."""
    _log_to(log_path)
    vllm_attr(BENCH_MODULES, "main")
    return os.getpid()


def _run_logged(argv: list[str], log_path: str, api_key: str | None = None) -> dict[str, Any]:
    # The key goes into this worker's environment only (vLLM's benchmark sends OPENAI_API_KEY as the bearer
    # token): set in the caller's, every process started after it (Ray's among them) would carry it.
    if api_key:
        os.environ[BENCH_KEY_ENV] = api_key
    _log_to(log_path)
    try:
        return run_vllm_bench(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class BenchWorker:
    """A worker process that runs benchmark passes one at a time: called with an argv, it returns vLLM's result
    dict. `pid` is that process, whose CPU time is the load generator's (a client that uses a whole core limits
    what it measures)."""

    def __init__(self, pool: ProcessPoolExecutor, log_path: Path, api_key: str | None) -> None:
        self._pool, self._log_path, self._api_key = pool, str(log_path), api_key
        self.pid: int = pool.submit(_prepare, self._log_path).result()

    def __call__(self, argv: list[str]) -> dict[str, Any]:
        return self._pool.submit(_run_logged, argv, self._log_path, self._api_key).result()


@contextlib.contextmanager
def vllm_bench_worker(log_path: Path, api_key: str | None = None) -> Iterator[BenchWorker]:
    """A BenchWorker: vLLM and its imports stay out of the caller, and everything they print goes to `log_path`."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield BenchWorker(pool, log_path, api_key)


def report_row(concurrency: int, result: dict[str, Any]) -> dict[str, Any]:
    """One pass of vLLM's benchmark result -> the numbers we report (latencies in ms)."""
    goodput = result.get("request_goodput")
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "completed": int(result["completed"]),
        "failed": int(result["failed"]),
        "duration_s": float(result["duration"]),
        "output_tok_s": float(result["output_throughput"]),
        "req_s": float(result["request_throughput"]),
        "goodput_req_s": None if goodput is None else float(goodput),
    }
    for metric in LATENCY_METRICS:
        stats = {"mean": float(result[f"mean_{metric}_ms"])}
        stats.update({f"p{p}": float(result[f"p{p}_{metric}_ms"]) for p in PERCENTILES})
        row[f"{metric}_ms"] = stats
    return row


def first_error(result: dict[str, Any]) -> str | None:
    return next((e for e in result.get("errors") or [] if e), None)


def scalar_fields(result: dict[str, Any]) -> dict[str, Any]:
    """vLLM's result without the per-request lists, as plain JSON values."""
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in result.items() if not isinstance(v, list)}


def bench(config: ServeConfig, exp_dir: str, console: Console, api_key: str | None = None) -> int:
    state = RunState.load(exp_dir)
    if state is None:
        raise FlagScaleError(f"nothing is running for exp_dir {exp_dir}; start it with action=run first")
    model = config.experiment.bench.model or state.models[0]
    if model not in state.models:
        raise FlagScaleError(
            f"model {model!r} is not served by this run; models: {', '.join(state.models)}", "experiment.bench.model"
        )
    settings = bench_settings(config, model)
    _check_healthy(state.endpoint)
    tokenizer = tokenizer_for(config, model) or _model_root(state.endpoint, model, api_key)

    out_dir = Path(exp_dir) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    log_path = stem.with_suffix(".log")
    console.print(
        f"benchmarking {model} at {state.endpoint}{settings.endpoint}: random dataset, "
        f"{settings.num_prompts} prompts of {settings.input_len} -> {settings.output_len} tokens"
    )
    rows, raw_results, errors = _passes(state.endpoint, model, tokenizer, settings, log_path, console, api_key)

    report = {
        "exp_dir": exp_dir,
        "endpoint": state.endpoint,
        "model": model,
        "tokenizer": tokenizer,
        "settings": settings.model_dump(),
        "rows": rows,
        "vllm_results": raw_results,
    }
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    write_plot(
        rows,
        stem.with_suffix(".png"),
        f"{model} at {state.endpoint}{settings.endpoint}: {settings.input_len} in / {settings.output_len} out tokens",
    )
    render(console, rows, show_goodput=settings.slo_ttft_ms is not None or settings.slo_tpot_ms is not None)
    console.print(f"results: {stem.with_suffix('.json')}\nplot   : {stem.with_suffix('.png')}\nlog    : {log_path}")
    if errors:
        console.print("[red]some requests failed:[/]\n  " + "\n  ".join(errors))
        return 1
    return 0


def _passes(
    endpoint: str,
    model: str,
    tokenizer: str,
    settings: BenchConfig,
    log_path: Path,
    console: Console,
    api_key: str | None,
):
    """One pass of vLLM's serving benchmark per concurrency: (report rows, raw results, errors)."""
    rows, raw_results, errors = [], [], []
    with vllm_bench_worker(log_path, api_key) as run_pass:
        for concurrency in settings.concurrency:
            console.print(f"  concurrency {concurrency} ...", end="")
            t0 = time.monotonic()
            argv = vllm_bench_argv(endpoint, model, tokenizer, settings, concurrency)
            try:
                result = run_pass(argv)
            except FlagScaleError:  # e.g. vLLM's benchmark not found in the installed release
                raise
            except Exception as exc:
                raise FlagScaleError(
                    f"vLLM's serving benchmark failed at concurrency {concurrency}: {exc}; its output is in {log_path}"
                ) from exc
            console.print(f" {time.monotonic() - t0:.0f}s")
            rows.append(report_row(concurrency, result))
            raw_results.append(scalar_fields(result))
            if result["failed"]:
                errors.append(f"concurrency {concurrency}: {result['failed']} failed, e.g. {first_error(result)}")

    return rows, raw_results, errors


def node_serving(config: ServeConfig, model: str) -> NodeConfig | None:
    """The engine node whose served names include `model`."""
    for node in config.serve:
        if node.is_engine and model in served_names(node, engine_args_of(node, config)):
            return node
    return None


def bench_settings(config: ServeConfig, model: str) -> BenchConfig:
    """experiment.bench, with the serving node's FlagScale `profile` for every key experiment.bench leaves unset."""
    settings = config.experiment.bench
    node = node_serving(config, model)
    if node is None or node.profile is None:
        return settings
    from_profile = {
        key: value
        for key, value in node.profile.model_dump(exclude_none=True).items()
        if key not in settings.model_fields_set
    }
    return settings.model_copy(update=from_profile)


def tokenizer_for(config: ServeConfig, model: str) -> str | None:
    """The tokenizer (or model path) of the engine node that serves `model`, as the config gives it."""
    node = node_serving(config, model)
    if node is None:
        return None
    args = engine_args_of(node, config)
    return args.get("tokenizer") or args.get("model")


def _model_root(endpoint: str, model: str, api_key: str | None = None) -> str:
    """The running server's own answer: vLLM's /v1/models lists each model's path as `root`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(endpoint + "/v1/models", headers=headers), timeout=10) as resp:
        entries = json.load(resp)["data"]
    root = next((e.get("root") for e in entries if e["id"] == model), None)
    if not root:
        raise FlagScaleError(
            f"cannot tell which tokenizer {model!r} uses: not in the config, and {endpoint}/v1/models gives no root",
            "experiment.bench.model",
        )
    return root


def _check_healthy(endpoint: str) -> None:
    problem = health_problem(endpoint, timeout_s=5)
    if problem:
        raise FlagScaleError(f"the deployment at {endpoint} is not serving ({problem}); see action=status")


def render(console: Console, rows: list[dict[str, Any]], show_goodput: bool) -> None:
    summary = Table(title="throughput", title_justify="left")
    columns = ["concurrency", "ok", "failed", "duration s", "output tok/s", "req/s"]
    columns += ["goodput req/s"] if show_goodput else []
    for column in columns:
        summary.add_column(column, justify="right")
    for r in rows:
        cells = [
            str(r["concurrency"]),
            str(r["completed"]),
            str(r["failed"]),
            f"{r['duration_s']:.1f}",
            f"{r['output_tok_s']:.1f}",
            f"{r['req_s']:.2f}",
        ]
        if show_goodput:
            cells.append(f"{r['goodput_req_s']:.2f}")
        summary.add_row(*cells)
    console.print(summary)
    latency = Table(title="latency (ms)", title_justify="left")
    for column in ["concurrency", "metric", "mean", *(f"p{p}" for p in PERCENTILES)]:
        latency.add_column(column, justify="right")
    for r in rows:
        for metric in LATENCY_METRICS:
            stats = r[f"{metric}_ms"]
            latency.add_row(str(r["concurrency"]), metric.upper(), *(f"{stats[k]:.1f}" for k in stats))
        latency.add_section()
    console.print(latency)


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    concurrency = [r["concurrency"] for r in rows]
    fig = matplotlib_figure.Figure(figsize=(11, 4.2))
    ax_tput, ax_lat = fig.subplots(1, 2)
    ax_tput.plot(concurrency, [r["output_tok_s"] for r in rows], marker="o")
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("throughput")
    ax_lat.plot(concurrency, [r["ttft_ms"]["p50"] for r in rows], marker="o", label="TTFT p50")
    ax_lat.plot(concurrency, [r["tpot_ms"]["p50"] for r in rows], marker="s", label="TPOT p50")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency")
    ax_lat.legend()
    for ax in (ax_tput, ax_lat):
        ax.set_xlabel("max concurrency")
        if len(concurrency) > 1:
            ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def act(ctx: ActionContext) -> int:
    return bench(ctx.config, ctx.exp_dir, ctx.console, ctx.api_key)
