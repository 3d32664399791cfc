"""The router's admin call for LoRA adapters (flagscale/router/adapter_admin.py): which changes it takes, the spec a
router serves once a set was given at run time, and what it reports per replica. Live engines: tests/e2e/test_lora.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flagscale.demo_model import ensure_demo_lora
from flagscale.facts import TargetFacts
from flagscale.plan import build_plan
from flagscale.replica.registry import ReplicaRecord
from flagscale.router.adapter_admin import BadChange, changed_set, progress
from flagscale.serve.app import router_spec
from tests.unit.test_lora_config import SOURCES, config


@pytest.fixture(scope="module")
def adapters() -> dict[str, Path]:
    return {name: ensure_demo_lora(f"admin-{name}") for name in ("a", "b", "c")}


@pytest.fixture
def spec(demo_model_path, adapters):
    cfg = config(demo_model_path, {"adapters": {"a": str(adapters["a"]), "b": str(adapters["b"])}, "max_loras": 2})
    return router_spec(build_plan(cfg, SOURCES, target_facts=TargetFacts(cpus=8)))


def test_the_spec_carries_what_an_added_adapter_is_checked_against(spec, demo_model_path):
    node = spec.lora_nodes["m"]
    assert node.base == "m" and node.served == ["m"] and node.model == str(demo_model_path)
    assert node.max_lora_rank == 16 and node.default_rank_limit  # vLLM's default bound
    assert set(node.adapters) == {"a", "b"}
    again = spec.reconfigured(json.loads(json.dumps(spec.user_config())))  # Serve's user_config is JSON
    assert again.lora_nodes == spec.lora_nodes


def test_a_set_given_at_run_time_replaces_the_configured_one_in_the_routers_spec(spec, adapters):
    served = spec.with_adapter_sets({"m": {"b": str(adapters["b"]), "c": str(adapters["c"])}})
    assert served.models == {"m": "m", "b": "m", "c": "m"}
    assert served.adapters == {"b": "m", "c": "m"}
    assert served.routing["c"] == served.routing["m"] and served.engines["c"] == "vllm"
    assert "a" not in served.routing and "a" not in served.engines
    assert spec.with_adapter_sets({}) == spec
    assert spec.with_adapter_sets({"gone": {"x": "/x"}}) == spec  # a node an update removed


def test_an_adapter_is_added_and_one_removed(spec, adapters):
    serve_id, wanted = changed_set(spec, {}, {"model": "m", "add": {"c": str(adapters["c"])}, "remove": ["a"]})
    assert serve_id == "m" and wanted == {"b": str(adapters["b"]), "c": str(adapters["c"])}
    # the next change starts from the set given at run time, not from the config's
    _, again = changed_set(spec, {"m": wanted}, {"model": "m", "remove": ["c"]})
    assert again == {"b": str(adapters["b"])}


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "the body is"),
        ({"model": "m", "replace": {}}, "the body is"),
        ({"model": "nope"}, "model 'nope' is no base model with LoRA here; those are: m"),
        ({"model": "m", "add": ["c"]}, '"add" is an object'),
        ({"model": "m", "remove": "a"}, '"remove" is a list'),
        ({"model": "m", "remove": ["zz"]}, "remove: 'zz' is no adapter of 'm'"),
        ({"model": "m", "add": {"m": "/x"}}, "add: 'm' is already a model here"),
        ({"model": "m", "add": {"a b": "/x"}}, "add: 'a b' is no adapter name"),
        ({"model": "m", "add": {"d": "/no/such/dir"}}, "LoRA adapter 'd': /no/such/dir is no directory"),
    ],
)
def test_a_bad_change_is_refused_naming_the_culprit(spec, body, message):
    with pytest.raises(BadChange) as refused:
        changed_set(spec, {}, body)
    assert message in str(refused.value)


def test_an_adapter_of_another_base_or_too_high_a_rank_is_refused(spec, adapters, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_model.safetensors").write_bytes((adapters["c"] / "adapter_model.safetensors").read_bytes())
    config_json = json.loads((adapters["c"] / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config_json, "base_model_name_or_path": "org/other"}))
    with pytest.raises(BadChange, match="base_model_name_or_path is 'org/other'"):
        changed_set(spec, {}, {"model": "m", "add": {"d": str(other)}})
    (other / "adapter_config.json").write_text(json.dumps({**config_json, "r": 64}))
    with pytest.raises(BadChange, match="r is 64, above the engine's default max_lora_rank 16"):
        changed_set(spec, {}, {"model": "m", "add": {"d": str(other)}})


def record(replica: str, models: list[str], errors: dict | None = None, serve_id: str = "m") -> ReplicaRecord:
    return ReplicaRecord(
        app="app", serve_id=serve_id, replica_id=replica, models=models, url="http://x", node_id="n", node_ip="1.2.3.4",
        pid=1, engine_pid=2, log_path="/l", updated_at=0.0, adapter_errors=errors or {},
    )  # fmt: skip


def test_progress_says_per_replica_what_is_loaded_refused_pending_and_dropping(spec):
    wanted = {"b": "/b", "c": "/c", "d": "/d"}
    records = [
        record("r1", ["m", "b", "c", "d"]),
        record("r2", ["m", "a", "b"], {"d": "loading /d failed: HTTP 400"}),
        record("r3", ["other"], serve_id="o"),  # another node's
    ]
    report = progress(records, "m", spec.lora_nodes["m"], wanted)
    assert report == {
        "r1": {"loaded": ["b", "c", "d"], "refused": {}, "pending": [], "dropping": []},
        "r2": {"loaded": ["b"], "refused": {"d": "loading /d failed: HTTP 400"}, "pending": ["c"], "dropping": ["a"]},
    }
    # a node served by several names: none of them counts as an adapter
    both = replace(spec.lora_nodes["m"], served=["m", "m2"])
    assert progress([record("r1", ["m", "m2", "b"])], "m", both, {"b": "/b"})["r1"]["dropping"] == []
