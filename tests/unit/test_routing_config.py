"""`routing` of a node: schema, plan (EnginePlan.routing) and the router's per-model spec."""

from __future__ import annotations

import pytest

from flagscale.config.load import ConfigSources, load_config
from flagscale.config.routing import RoutingSpec
from flagscale.errors import ConfigError
from flagscale.plan import build_plan

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/demo.yaml")


def config(model, **node):
    return {
        "experiment": {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}},
        "serve": [
            {
                "serve_id": "a",
                "engine": "vllm",
                "engine_args": {"model": str(model), "max_model_len": 256, "served_model_name": ["a", "a2"]},
                **node,
            },
            {"serve_id": "b", "engine": "vllm", "engine_args": {"model": str(model), "max_model_len": 256}},
        ],
    }


def test_engine_nodes_default_to_cache_aware_and_take_their_options(demo_model_path):
    cfg = config(demo_model_path, routing="session", routing_options={"max_sessions": 10})
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    a, b = plan.engines
    assert a.routing == RoutingSpec.of("session", max_sessions=10)
    assert b.routing == RoutingSpec(policy="cache_aware")


def test_app_gives_the_router_each_model_its_nodes_policy(demo_model_path):
    from flagscale.serve.app import router_spec

    plan = build_plan(load_config(config(demo_model_path, routing="round_robin"), SOURCES), SOURCES, check_port=False)
    spec = router_spec(plan)
    assert {m: r.policy for m, r in spec.routing.items()} == {
        "a": "round_robin",
        "a2": "round_robin",
        "b": "cache_aware",
    }


def test_unknown_policy_and_routing_on_a_custom_node_are_refused(demo_model_path):
    with pytest.raises(ConfigError, match="routing"):
        load_config(config(demo_model_path, routing="fastest"), SOURCES)
    with pytest.raises(ConfigError, match="routing"):
        load_config(config(demo_model_path, routing_options={"balance_abs_threshold": -1}), SOURCES)
    cfg = config(demo_model_path)
    cfg["serve"].append({"serve_id": "c", "module": "x.py", "name": "C", "routing": "least_load"})
    with pytest.raises(ConfigError, match="engine nodes"):
        load_config(cfg, SOURCES)


def test_bad_routing_options_are_refused_naming_the_key(demo_model_path):
    cases = {
        "routing_options.max_sessions is a setting of session, not of routing least_load": {
            "routing": "least_load",
            "routing_options": {"max_sessions": 10},
        },
        "routing_options.max_sessions is a setting of session, not of routing cache_aware": {
            "routing_options": {"max_sessions": 10}
        },
        "unknown key 'max_session'": {"routing": "session", "routing_options": {"max_session": 10}},
        "routing_options.cache_threshold: Input should be a valid number": {
            "routing_options": {"cache_threshold": "x"}
        },
        "routing_options.balance_scope: Input should be 'device' or 'replica'": {
            "routing_options": {"balance_scope": "gpu"}
        },
    }
    for message, node in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(config(demo_model_path, **node), SOURCES)
    load_config(config(demo_model_path, routing="round_robin", routing_options={"max_migrations": 0}), SOURCES)


def test_a_prefill_pool_of_another_policy_takes_the_nodes_options_it_has(demo_model_path):
    cfg = config(demo_model_path, routing="session", routing_options={"max_sessions": 10, "max_migrations": 1})
    node = load_config(cfg, SOURCES).serve[0]
    assert RoutingSpec.of_node(node) == RoutingSpec.of("session", max_sessions=10, max_migrations=1)
    prefill = node.model_copy(update={"routing": "round_robin"})
    assert RoutingSpec.of_node(prefill) == RoutingSpec.of("round_robin", max_migrations=1)


def test_the_router_spec_goes_through_serve_user_config_as_json_and_back():
    import json
    from dataclasses import fields

    from flagscale.config.routing import Admission
    from flagscale.router.spec import RouterSpec

    spec = RouterSpec(
        app="a",
        host="127.0.0.1",
        port=1,
        models={"m": "s", "p": "s"},
        routing={"m": RoutingSpec.of("session", max_sessions=3), "p": RoutingSpec.of("cache_aware", cache_threshold=0)},
        prefill_routing={"p": RoutingSpec(policy="random")},
        admission=Admission(max_body_bytes=10, max_queued_requests=2, queue_timeout_s=0.5),
        peer_secret="s",
    ).with_api_key("k" * 16)
    config = json.loads(json.dumps(spec.user_config()))
    fixed = {"app", "host", "port", "pin_cpus", "engine_key", "peer_secret", "share_with_peers"}
    assert fixed.isdisjoint(config) and set(config) | fixed == {f.name for f in fields(RouterSpec)}
    bare = RouterSpec(app="a", host="127.0.0.1", port=1, models={}, engine_key="k" * 16, peer_secret="s")
    assert bare.reconfigured(config) == spec
