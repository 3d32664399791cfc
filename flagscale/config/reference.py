"""docs/config.md's key tables, generated from the schema: each field's default and description, and how FlagScale's
key of the same name is handled here (flagscale/config/compat.py). `python -m flagscale.config.reference --write`
rewrites the generated part of docs/config.md; tests/unit/test_config_reference.py fails when it is stale."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from flagscale.config import schema
from flagscale.config.compat import FLAGSCALE_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
BEGIN = "<!-- generated: python -m flagscale.config.reference --write (from flagscale/config/schema.py) -->"
END = "<!-- end of generated part -->"

# (section title, model, key prefix as written in the config)
SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    ("Top level", schema.ServeConfig, ""),
    ("`experiment`", schema.ExperimentConfig, "experiment."),
    ("`experiment.task`", schema.TaskConfig, "experiment.task."),
    ("`experiment.runner`", schema.RunnerConfig, "experiment.runner."),
    ("`experiment.runner.deploy`", schema.DeployConfig, "experiment.runner.deploy."),
    ("`experiment.cmds`", schema.CmdsConfig, "experiment.cmds."),
    ("`experiment.bench`", schema.BenchConfig, "experiment.bench."),
    ("`experiment.node_args.<host>`", schema.NodeArgs, "experiment.node_args.<host>."),
    ("`experiment.auto_tuner`", schema.AutoTunerConfig, "experiment.auto_tuner."),
    ("`experiment.auto_tuner.control`", schema.TunerControl, "experiment.auto_tuner.control."),
    ("`experiment.auto_tuner.performance`", schema.TunerPerformance, "experiment.auto_tuner.performance."),
    ("`serve[]`: nodes", schema.NodeConfig, "serve[]."),
    ("`serve[].lora`", schema.LoraConfig, "serve[].lora."),
    ("`serve[].resources`", schema.Resources, "serve[].resources."),
    ("`serve[].profile`", schema.ProfileConfig, "serve[].profile."),
    ("`serve[].routing_options`", schema.RoutingOptions, "serve[].routing_options."),
]


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{_yaml(value)}`"
    return f"`{_yaml(info.default)}`" if info.default is not PydanticUndefined else ""


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _flagscale(path: str, info: Any) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "ignored_because" in extra:
        return "ignored (notice)"
    return FLAGSCALE_KEYS.get(path, "")


def _description(info: Any) -> str:
    text = info.description or ""
    return text.removeprefix("FlagScale key, accepted and ignored: ")


def render() -> str:
    lines = [BEGIN, ""]
    for title, model, prefix in SECTIONS:
        lines += [f"### {title}", "", "| key | default | FlagScale | meaning |", "|---|---|---|---|"]
        for name, info in model.model_fields.items():
            path = prefix + name
            cells = [f"`{name}`", _default(info), _flagscale(path, info), _description(info)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def with_generated(doc: str) -> str:
    """`doc` with its generated part replaced by render()."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + render() + doc[end:]


if __name__ == "__main__":
    current = DOC.read_text()
    updated = with_generated(current)
    if "--write" in sys.argv[1:]:
        DOC.write_text(updated)
    elif updated != current:
        sys.exit(f"{DOC} is stale: run python -m flagscale.config.reference --write")
