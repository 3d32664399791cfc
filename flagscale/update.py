"""In-place updates: what changed between the config a deployment runs and the one `run` is given again.

`run` records a snapshot of the validated config in the state file; a later `run` on the same exp_dir diffs the
new config against it. Changes to the graph's nodes (engine args, resources, routing, nodes added or removed,
replica counts) and to the deployment settings of the endpoint are applied in place by redeploying the Serve
application (flagscale/actions/update_in_place.py); changes to what the running cluster was started with (hosts,
ports, env vars, shell hooks, the experiment's name and directory) are refused, and nothing is changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flagscale.config.graph import GraphPlan
from flagscale.config.schema import ServeConfig
from flagscale.secrets import MASK, SECRET_NAME

# Paths under `experiment` that are applied in place; everything else under it is fixed while the cluster runs.
IN_PLACE = ("experiment.runner.deploy.", "experiment.node_args.", "experiment.task.")
FIXED = ("experiment.runner.deploy.host", "experiment.runner.deploy.port")
# What has no effect on a running deployment (used by other actions only).
IGNORED = ("experiment.bench.", "experiment.auto_tuner")
# Recorded and compared only as digests, shown only as "changed": every env var value (HF_TOKEN, ...), the API
# key, and engine args named like a credential (api_key, hf_token, ...).
SECRET_PATHS = ("experiment.envs.", "experiment.runner.deploy.api_key_digest")


@dataclass(frozen=True)
class Change:
    path: str  # dotted; nodes by serve_id: serve.<serve_id>.engine_args.max_num_seqs
    old: Any  # MISSING when added
    new: Any  # MISSING when removed

    @property
    def in_place(self) -> bool:
        if self.path.startswith("serve."):
            return True
        return self.path.startswith(IN_PLACE) and not self.path.startswith(FIXED)

    @property
    def secret(self) -> bool:
        return self.path.startswith(SECRET_PATHS) or bool(SECRET_NAME.search(self.path.rpartition(".")[2]))

    def describe(self) -> str:
        if self.secret:
            what = "added" if self.old is MISSING else "removed" if self.new is MISSING else "changed"
            return f"{self.path}: {what} (value not shown)"
        if self.old is MISSING:
            return f"{self.path}: added ({_show(self.new)})"
        if self.new is MISSING:
            return f"{self.path}: removed (was {_show(self.old)})"
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def snapshot(config: ServeConfig, api_key: str | None, graph: GraphPlan | None = None) -> dict[str, Any]:
    """What a deployment runs, as JSON: the experiment and the nodes (keyed by serve_id), the API key only as a
    digest (a changed key is still a change; the key itself never reaches the state file), and with the planned
    `graph`, each custom node's module file as a digest of its code (edited code is a change too)."""
    experiment = config.experiment.model_dump(mode="json", exclude_none=True)
    deploy = experiment["runner"]["deploy"]
    deploy.pop("api_key", None)
    if api_key:
        deploy["api_key_digest"] = hashlib.sha256(api_key.encode()).hexdigest()[:16]
    experiment["envs"] = _map_leaves(experiment.get("envs", {}), digest)
    nodes = {
        node.serve_id: mask_secrets(node.model_dump(mode="json", exclude_none=True), digest) for node in config.serve
    }
    for custom in graph.nodes if graph is not None else []:
        nodes[custom.serve_id]["module_digest"] = custom.module_digest
    return {"experiment": experiment, "serve": nodes}


def digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()[:16]


def mask_secrets(tree: Any, hide=lambda _value: MASK) -> Any:
    """`tree` with the value of every key named like a credential (SECRET_NAME) replaced by hide(value)."""
    if isinstance(tree, dict):
        return {
            k: _map_leaves(v, hide) if SECRET_NAME.search(str(k)) else mask_secrets(v, hide) for k, v in tree.items()
        }
    if isinstance(tree, list):
        return [mask_secrets(v, hide) for v in tree]
    return tree


def masked_config(config: ServeConfig) -> dict[str, Any]:
    """The resolved config as printed: env var values and credentials (api_key, engine args such as hf_token)
    as ***."""
    resolved = mask_secrets(config.model_dump(mode="json", exclude_none=True))
    resolved["experiment"]["envs"] = _map_leaves(resolved["experiment"].get("envs", {}), lambda _value: MASK)
    return resolved


def _map_leaves(tree: Any, fn) -> Any:
    if isinstance(tree, dict):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_leaves(v, fn) for v in tree]
    return fn(tree) if tree is not None else tree


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every leaf that differs, in the new config's order (removed ones last); ignored sections left out."""
    before, after = _flatten(old), _flatten(new)
    changes = [Change(p, before.get(p, MISSING), v) for p, v in after.items() if before.get(p, MISSING) != v]
    changes += [Change(p, v, MISSING) for p, v in before.items() if p not in after]
    return [c for c in changes if not c.path.startswith(IGNORED)]


def replicas_running(running: dict[str, Any], serve_id: str) -> int | None:
    """The replica count a running snapshot gave node `serve_id` (None: no such node, or no fixed count)."""
    count = running.get("serve", {}).get(serve_id, {}).get("resources", {}).get("num_replicas")
    return count if isinstance(count, int) else None


def changed_nodes(changes: list[Change]) -> list[str]:
    return list(dict.fromkeys(c.path.split(".")[1] for c in changes if c.path.startswith("serve.")))


# A node's settings that change how many replicas run, not what each one runs: Serve rescales, replacing none.
SCALE_ONLY = tuple(
    f"resources.{key}"
    for key in ("num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                "downscale_delay_s")
)  # fmt: skip


def replaced_nodes(changes: list[Change]) -> list[str]:
    """The changed nodes whose replicas are replaced: a change beyond their count, or autoscaling turned on or off
    (a fixed count and autoscaling are different versions: flagscale/serve/app.py engine_version)."""
    return list(dict.fromkeys(c.path.split(".")[1] for c in changes if c.path.startswith("serve.") and _replaces(c)))


# A node's LoRA adapters: its running replicas load and unload them (EngineReplica.reconfigure), replacing none.
ADAPTER_SET = ("lora.adapters", "engine_args.lora_modules")


def _replaces(change: Change) -> bool:
    key = change.path.split(".", 2)[2]
    if key.startswith(ADAPTER_SET):
        return False
    if key == "resources.num_replicas":
        return _fixed_count(change.old) != _fixed_count(change.new)
    return key not in SCALE_ONLY and not key.startswith("resources.slo")  # the SLO planner's: scale only


def _fixed_count(value: Any) -> bool:
    return isinstance(value, int) or value == "auto"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
