"""In-place updates, the pure parts: what changed between two configs and which changes apply in place
(flagscale/update.py), the deployment versions that make Serve restart only what changed (serve/app.py), and
the router taking a new spec without a restart (Router.reconfigure)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from flagscale.actions import update_in_place
from flagscale.cli.argv import serve_invocation
from flagscale.config.routing import RoutingSpec
from flagscale.config.schema import ServeConfig
from flagscale.errors import DeployError
from flagscale.replica.autoscaling import with_engine_load_policy
from flagscale.replica.registry import version_of
from flagscale.router.router import Router
from flagscale.router.spec import RouterSpec
from flagscale.serve.app import _one_at_a_time, engine_version
from flagscale.update import MISSING, Change, changed_nodes, diff, replicas_running, snapshot


def config(**deploy) -> ServeConfig:
    return ServeConfig.model_validate(
        {
            "experiment": {
                "exp_name": "x",
                "exp_dir": "/tmp/x",
                "runner": {"deploy": {"port": 9000, **deploy}},
                "envs": {"A": "1"},
            },
            "serve": [
                {"serve_id": "a", "engine": "vllm", "engine_args": {"model": "m", "max_num_seqs": 8}},
                {"serve_id": "b", "engine": "vllm", "engine_args": {"model": "m2"}},
            ],
        }
    )


def test_the_same_config_is_no_change():
    assert diff(snapshot(config(), None), snapshot(config(), None)) == []


def test_nodes_are_compared_by_serve_id_not_position():
    old, new = config(), config()
    new.serve.reverse()
    new.serve[1].engine_args["max_num_seqs"] = 4
    changes = diff(snapshot(old, None), snapshot(new, None))
    assert changes == [Change("serve.a.engine_args.max_num_seqs", 8, 4)]
    assert changes[0].in_place and changes[0].describe() == "serve.a.engine_args.max_num_seqs: 8 -> 4"
    assert changed_nodes(changes) == ["a"]


def test_the_running_replica_count_is_read_from_the_snapshot():
    # An update from 1 replica to 2 replaces the one running replica: what decides whether serving would stop.
    running = config()
    running.serve[0].resources.num_replicas = 1
    running.serve[1].resources.num_replicas = 3
    recorded = snapshot(running, None)
    assert replicas_running(recorded, "a") == 1 and replicas_running(recorded, "b") == 3
    assert replicas_running(recorded, "gone") is None


def test_added_and_removed_nodes_and_keys_are_changes_in_place():
    old, new = config(), config()
    del new.serve[1]
    new.serve[0].engine_args["dtype"] = "float32"
    changes = diff(snapshot(old, None), snapshot(new, None))
    assert Change("serve.a.engine_args.dtype", MISSING, "float32") in changes
    assert any(c.path.startswith("serve.b.") and c.new is MISSING for c in changes)
    assert all(c.in_place for c in changes) and set(changed_nodes(changes)) == {"a", "b"}


def test_what_the_cluster_was_started_with_cannot_change_in_place():
    old = snapshot(config(), None)
    for change_of in (
        lambda c: setattr(c.experiment.runner.deploy, "port", 9001),
        lambda c: setattr(c.experiment.runner.deploy, "host", "0.0.0.0"),
        lambda c: c.experiment.envs.update(A="2"),
        lambda c: setattr(c.experiment.runner, "hostfile", "/etc/hosts"),
        lambda c: setattr(c.experiment, "exp_name", "y"),
    ):
        new = config()
        change_of(new)
        (change,) = diff(old, snapshot(new, None))
        assert not change.in_place, change
    new = config(drain_timeout_s=5)
    (change,) = diff(old, snapshot(new, None))
    assert change.in_place and change.path == "experiment.runner.deploy.drain_timeout_s"


def test_the_api_key_is_compared_by_digest_and_never_recorded():
    with_key = snapshot(config(api_key="sekret-0123456789"), "sekret-0123456789")
    assert "sekret-0123456789" not in str(with_key)
    (change,) = diff(with_key, snapshot(config(api_key="other-0123456789ab"), "other-0123456789ab"))
    assert change.path == "experiment.runner.deploy.api_key_digest" and change.in_place
    assert diff(with_key, snapshot(config(api_key="sekret-0123456789"), "sekret-0123456789")) == []


def test_versions_follow_what_replicas_are_built_from():
    assert version_of({"argv": ["--max-num-seqs", "8"]}) == version_of({"argv": ["--max-num-seqs", "8"]})
    assert version_of({"argv": ["--max-num-seqs", "8"]}) != version_of({"argv": ["--max-num-seqs", "4"]})
    # one new replica at a time, started before an old one stops (unless there is no room for it)
    assert _one_at_a_time(1, spare=True) == {"rolling_update_percentage": 1.0, "max_surge_percent": 100}
    assert _one_at_a_time(3, spare=True) == {"rolling_update_percentage": 1 / 3, "max_surge_percent": 34}
    assert _one_at_a_time(3, spare=False)["max_surge_percent"] == 0


def test_turning_autoscaling_on_or_off_replaces_engine_replicas_and_its_bounds_do_not():
    fixed = with_engine_load_policy({"num_replicas": 1})
    autoscaled = with_engine_load_policy({"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    wider = with_engine_load_policy({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    assert engine_version("v", fixed) == "v"  # a fixed count: the spec's version
    assert engine_version("v", autoscaled) != engine_version("v", fixed)
    assert engine_version("v", autoscaled) == engine_version("v", wider)
    assert engine_version("w", autoscaled) != engine_version("v", autoscaled)


def test_router_takes_a_new_spec_in_place_keeping_unchanged_policies():
    spec = RouterSpec(
        app="x",
        host="127.0.0.1",
        port=1,
        models={"a": "a", "b": "b"},
        routing={"a": RoutingSpec(policy="cache_aware"), "b": RoutingSpec(policy="least_load")},
        peer_secret="s" * 64,
    ).with_api_key("client-key-0123456789")
    router = Router.__new__(Router)
    router.spec = spec
    router.graph = None
    router._init_state()
    kept = router.replicas.policies["a"]
    config = spec.user_config()
    # Serve shows user_configs: no secret there (the client key as a digest under the peer secret); the listener
    # is fixed
    assert not {"engine_key", "peer_secret", "port"} & set(config) and "client-key" not in json.dumps(config)
    config["models"] = {"a": "a", "c": "c"}
    config["routing"] = {"a": config["routing"]["a"], "c": {"policy": "round_robin"}}
    router.reconfigure(config)
    assert router.replicas.policies["a"] is kept and set(router.replicas.policies) == {"a", "c"}
    assert router.spec.routing["c"] == RoutingSpec(policy="round_robin")
    assert router.spec.engine_key == "client-key-0123456789" and router.spec.client_keys == spec.client_keys
    assert asyncio.run(router.frontend.health(None)).status == 503  # model c has no replica yet


def test_update_of_a_deployment_without_a_config_record_is_refused_before_touching_it(tmp_path):
    from flagscale.actions.run import update
    from flagscale.cluster.state import RunState
    from flagscale.errors import FlagScaleError

    state = RunState(
        app_name="x", exp_dir=str(tmp_path), endpoint="http://127.0.0.1:1", ray_address="", token_path=None
    )
    with pytest.raises(FlagScaleError) as info:
        update(state, plan=None, snapshot=snapshot(config(), None), console=Console(), config_file="serve.yaml")
    assert "without a record of its config" in str(info.value) and "state.json" in str(info.value)


def test_update_refuses_a_fixed_key_naming_it_and_the_file(tmp_path):
    import pytest
    from rich.console import Console

    from flagscale.actions.run import update
    from flagscale.cluster.state import RunState
    from flagscale.errors import ConfigError

    state = RunState(app_name="x", exp_dir=str(tmp_path), endpoint="", ray_address="", token_path=None)
    state.extra["config"] = snapshot(config(), None)
    new = config()
    new.experiment.runner.deploy.port = 9001
    with pytest.raises(ConfigError) as info:  # before connecting to anything: plan=None is never read
        update(state, plan=None, snapshot=snapshot(new, None), console=Console(), config_file="serve.yaml")
    assert "serve.yaml: experiment.runner.deploy.port" in str(info.value) and "Nothing was changed" in str(info.value)


def test_an_update_without_room_for_a_spare_is_refused_while_one_replica_runs(monkeypatch):
    """One TP=2 replica holding both GPUs, asked to become two TP=1 replicas: no new replica can be placed beside
    it, and replacing it would stop serving: refused before anything changes, naming the node. With two running,
    they are replaced one at a time."""
    monkeypatch.setattr(update_in_place, "without_room_for_a_spare", lambda plan, nodes: frozenset(nodes))
    engine = SimpleNamespace(serve_id="a", initial_replicas=2, ray_actor_options={"num_cpus": 1, "num_gpus": 1.0})
    plan = SimpleNamespace(engines=[engine])
    one_running = config()
    one_running.serve[0].resources.num_replicas = 1
    with pytest.raises(DeployError, match="no node has room for a spare replica of 'a'.*GPU:1"):
        update_in_place.spares(plan, ["a"], Console(), snapshot(one_running, None))
    served = serve_invocation("demo", None, [])  # what to do is said in the form the user typed
    with pytest.raises(DeployError, match="or `flagscale serve demo --stop`, then `flagscale serve demo`$"):
        update_in_place.spares(plan, ["a"], Console(), snapshot(one_running, None), served)
    two_running = config()
    two_running.serve[0].resources.num_replicas = 2
    assert update_in_place.spares(plan, ["a"], Console(), snapshot(two_running, None)) == {"a"}


def test_an_update_serve_would_wait_on_forever_is_refused_naming_the_node_and_the_step(monkeypatch):
    """Two one-GPU replicas on 4 GPUs asked to become two-GPU replicas (auto_tune's 2 x 1 -> 2 x 2): the second new
    replica would find 1 GPU free. Refused before anything is deployed; a pure scale-down of the same node is not."""
    monkeypatch.setattr(update_in_place, "free_resources_per_node", lambda: {"n1": {"GPU": 2.0, "CPU": 8.0}})
    held = {"GPU": 1.0, "CPU": 1.0}
    monkeypatch.setattr(update_in_place, "running_replicas", lambda app, serve_id: [("n1", held), ("n1", held)])
    engine = SimpleNamespace(serve_id="a", initial_replicas=2, ray_actor_options={"num_cpus": 1, "num_gpus": 2.0})
    plan = SimpleNamespace(engines=[engine], app_name="app")
    with pytest.raises(DeployError, match=r"updating 'a' in place \(2 -> 2 replica\(s\)\).*new replica 2 of 2"):
        update_in_place.refuse_if_stuck(plan, ["a"], ["a"], frozenset())
    engine.initial_replicas, engine.ray_actor_options = 1, {"num_cpus": 1, "num_gpus": 1.0}
    update_in_place.refuse_if_stuck(plan, ["a"], [], frozenset())  # only the count changes: nothing to wait on
