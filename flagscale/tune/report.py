"""The search's result a person reads: the ranking, a table that fits 80 columns, the plot, the best config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from flagscale.adaptors import matplotlib_figure
from flagscale.config.schema import ServeConfig
from flagscale.paths import private_dir, write_private
from flagscale.update import SECRET_NAME

# The variable the best config reads the API key from when the tuned config gave the key itself.
BEST_KEY_ENV = "FLAGSCALE_API_KEY"

# FlagScale's serve metric names (its recorder's columns, means in ms) -> history.csv columns.
FLAGSCALE_METRICS = {
    "itl": "itl_mean_ms",
    "ttft": "ttft_mean_ms",
    "tpot": "tpot_mean_ms",
    "topt": "tpot_mean_ms",  # FlagScale's recorder spells it so
    "e2e_latency": "e2el_mean_ms",
    "request_throughput": "request_throughput",
    "token_throughput": "total_token_throughput",
}


def metric_column(metric: str) -> str:
    return FLAGSCALE_METRICS.get(metric, metric)


def rank(rows: list[dict[str, Any]], slo: Any, metric: str, order: str) -> list[dict[str, Any]]:
    """The finished candidates, best first. With an SLO: those that meet it by goodput per device (highest first);
    the others after them, closest to the SLO first. Without one: by `metric` in `order`."""
    done = [r for r in rows if r.get("status") == "done"]
    if slo is not None:
        met = sorted((r for r in done if r.get("goodput")), key=lambda r: -r["goodput_per_device"])
        missed = sorted(
            (r for r in done if not r.get("goodput")),
            key=lambda r: r["slo_ratio"] if r.get("slo_ratio") is not None else float("inf"),
        )
        return met + missed
    column = metric_column(metric)
    valued = [r for r in done if isinstance(r.get(column), (int, float))]
    return sorted(valued, key=lambda r: r[column], reverse=order == "descend")


def best_of(ranked: list[dict[str, Any]], slo: Any) -> dict[str, Any] | None:
    """The winner; with an SLO only one that meets it."""
    if not ranked:
        return None
    if slo is not None and not ranked[0].get("goodput"):
        return None
    return ranked[0]


def render(
    console: Console, rows: list[dict[str, Any]], ranked: list[dict[str, Any]], dims: list[str], slo: Any
) -> None:
    table = Table(title="auto_tune: candidates, best first", title_justify="left", expand=False)
    for column, justify in (
        ("#", "right"),
        ("candidate", "left"),
        ("status", "left"),
        ("goodput/dev", "right"),
        ("req/s", "right"),
        ("TTFT p99", "right"),
        ("TPOT p99", "right"),
    ):
        table.add_column(column, justify=justify, overflow="fold")
    ordered = ranked + [r for r in rows if r not in ranked]
    for index, row in enumerate(ordered, 1):
        status = row.get("status") or "?"
        if status == "done" and slo is not None and not row.get("goodput"):
            status = "missed SLO"
        if status in ("skipped", "failed"):
            status += f": {row.get('reason') or ''}"[:60]
        table.add_row(
            str(index) if row in ranked else "-",
            " ".join(f"{d}={row.get(d)}" for d in dims),
            status,
            _num(row.get("goodput_per_device"), 3),
            _num(row.get("request_throughput"), 2),
            _num(row.get("ttft_p99_ms"), 0, " ms"),
            _num(row.get("tpot_p99_ms"), 1, " ms"),
        )
    console.print(table)


def _num(value: Any, digits: int, unit: str = "") -> str:
    return f"{value:.{digits}f}{unit}" if isinstance(value, (int, float)) else "-"


def write_plot(rows: list[dict[str, Any]], best: dict[str, Any] | None, slo: Any, path: Path, title: str) -> None:
    """Request throughput against p99 TTFT and p99 TPOT, one point per measured candidate (labelled by its row in
    history.csv), the SLO limits as dashed lines, the best candidate as a star."""
    fig = matplotlib_figure.Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2)
    measured = [(i, r) for i, r in enumerate(rows, 1) if isinstance(r.get("request_throughput"), (int, float))]
    for ax, metric, label in ((axes[0], "ttft", "TTFT p99 (ms)"), (axes[1], "tpot", "TPOT p99 (ms)")):
        for index, row in measured:
            x, y = row[f"{metric}_p99_ms"], row["request_throughput"]
            ax.scatter([x], [y], color="tab:blue", s=30)
            ax.annotate(str(index), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if best is not None and isinstance(best.get("request_throughput"), (int, float)):
            ax.scatter(
                [best[f"{metric}_p99_ms"]],
                [best["request_throughput"]],
                marker="*",
                s=260,
                color="tab:red",
                label="best",
            )
        limit = (slo or {}).get(f"{metric}_ms", {}).get("p99")
        if limit is not None:
            ax.axvline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"SLO p99 {limit:g} ms")
        ax.set_xlabel(label)
        ax.set_ylabel("requests / s (at the reported concurrency)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_best_config(config: ServeConfig, exp_dir: str, out_dir: Path) -> tuple[Path, list[str]]:
    """The best candidate as a config tree `run.py --config-path <out_dir> --config-name serve` runs unchanged:
    the keys the config set (resolved: paths and ${...} filled in), the tuned node's new values, action=run.
    Secrets stay references (secret_references): returns the tree and the env vars it reads them from. The files
    are 0600 in a 0700 directory all the same."""
    data, env_vars = secret_references(config.model_dump(mode="json", exclude_unset=True))
    experiment = data["experiment"]
    experiment.pop("auto_tuner", None)
    experiment["exp_dir"] = exp_dir
    main = {
        "defaults": ["_self_", {"serve": "best"}],
        "experiment": experiment,
        "action": "run",
        "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
    }
    private_dir(out_dir)
    private_dir(out_dir / "serve")
    write_private(out_dir / "serve.yaml", yaml.safe_dump(main, sort_keys=False))
    write_private(out_dir / "serve" / "best.yaml", yaml.safe_dump(data["serve"], sort_keys=False))
    return out_dir, env_vars


def secret_references(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A dumped config with no secret value left in it, and the env vars it now reads them from: deploy.api_key
    becomes api_key_env (BEST_KEY_ENV); every experiment.envs value (nodes_envs too) becomes ${oc.env:<its name>};
    any other key named like a credential (hf_token, ...) becomes ${oc.env:<KEY IN CAPITALS>}."""
    env_vars: list[str] = []

    def reference(name: str) -> str:
        env_vars.append(name)
        return "${oc.env:" + name + "}"

    experiment = data.get("experiment", {})
    deploy = experiment.get("runner", {}).get("deploy", {})
    if deploy.pop("api_key", None) is not None:
        deploy["api_key_env"] = BEST_KEY_ENV
    if deploy.get("api_key_env"):
        env_vars.append(deploy["api_key_env"])
    envs = experiment.get("envs", {})
    for name in list(envs):
        if name == "nodes_envs":
            envs[name] = {host: {var: reference(var) for var in values} for host, values in envs[name].items()}
        else:
            envs[name] = reference(name)

    def walk(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {
                k: reference(str(k).upper())
                if SECRET_NAME.search(str(k)) and not str(k).endswith("_env") and isinstance(v, (str, int, float))
                else v
                if k == "envs"  # references already
                else walk(v)
                for k, v in tree.items()
            }
        if isinstance(tree, list):
            return [walk(v) for v in tree]
        return tree

    return walk(data), list(dict.fromkeys(env_vars))
