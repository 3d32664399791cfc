"""The engine side of KV-event routing: which replicas publish, on which ports, and what their record says."""

from __future__ import annotations

import json

import pytest

from flagscale import engines
from flagscale.config.routing import RoutingSpec
from flagscale.errors import ConfigError
from flagscale.plan.engine_plan import _kv_events


def test_vllm_publishes_on_the_ports_given_and_records_how_to_key_blocks():
    argv = ["--model", "/m", "--chat-template", "/t.jinja", "--prefix-caching-hash-algo", "sha256_cbor"]
    extra, record = engines.get("vllm").kv_events_launch(argv, "10.0.0.5", 31001, 31002, "kv@r1", {})
    assert extra[0] == "--kv-events-config"
    config = json.loads(extra[1])
    assert config["endpoint"] == "tcp://*:31001" and config["replay_endpoint"] == "tcp://10.0.0.5:31002"
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq" and config["topic"] == "kv@r1"
    assert record["endpoint"] == "tcp://10.0.0.5:31001" and record["replay_endpoint"] == "tcp://10.0.0.5:31002"
    assert (record["tokenizer"], record["chat_template"], record["hash_algo"]) == ("/m", "/t.jinja", "sha256_cbor")
    assert record["hash_seed"] == "vllm-none-hash"  # the engine's own seed without PYTHONHASHSEED


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--model", "/m", "--no-enable-prefix-caching"], {}),  # no prefix cache: nothing to route on
        (["--model", "/m", "--kv-events-config", "{}"], {}),  # the user's own publisher: left alone
        (["--model", "/m", "--prefix-caching-hash-algo", "xxhash"], {}),  # a random seed per process
        (["--model", "/m", "--tokenizer-mode", "mistral"], {}),  # a tokenizer the router does not load
    ],
)
def test_vllm_publishes_nothing_the_router_cannot_use(argv, env):
    assert engines.get("vllm").kv_events_launch(argv, "127.0.0.1", 1, 2, "t", env) is None


def test_xxhash_with_a_shared_seed_can_be_keyed():
    argv = ["--model", "/m", "--prefix-caching-hash-algo", "xxhash"]
    _, record = engines.get("vllm").kv_events_launch(argv, "127.0.0.1", 1, 2, "t", {"PYTHONHASHSEED": "7"})
    assert record["hash_seed"] == "7"


def test_which_nodes_publish():
    vllm, llama = engines.get("vllm"), engines.get("llama_cpp")
    auto, on, off = (RoutingSpec.of("cache_aware", kv_events=v) for v in ("auto", True, False))
    assert _kv_events(vllm, auto, (1, 1, 1), None, "serve[0]")
    assert not _kv_events(vllm, off, (1, 1, 1), None, "serve[0]")
    # other policies too: a switch to cache_aware in place then finds the engines publishing
    assert _kv_events(vllm, RoutingSpec.of("least_load"), (1, 1, 1), None, "serve[0]")
    assert not _kv_events(llama, auto, (1, 1, 1), None, "serve[0]")  # auto: llama.cpp keeps the table
    assert not _kv_events(vllm, auto, (1, 1, 2), None, "serve[0]")
    with pytest.raises(ConfigError, match="llama.cpp publishes no KV-cache events"):
        _kv_events(llama, on, (1, 1, 1), None, "serve[0]")
