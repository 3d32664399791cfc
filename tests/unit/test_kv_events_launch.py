"""The engine side of KV-event routing: which replicas publish, on which ports, and what their record says."""

from __future__ import annotations

import json
import tempfile

import pytest

from flagscale import engines
from flagscale.cluster.placement import Reservation
from flagscale.config.routing import RoutingSpec
from flagscale.errors import ConfigError
from flagscale.net import free_ports, port_is_free
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


def test_sglang_publishes_pages_of_16_or_more_on_the_ports_given_and_each_dp_rank_on_them_plus_its_rank():
    argv = ["--model-path", "/m", "--page-size", "32", "--dp-size", "2", "--tokenizer-path", "/tok"]
    extra, record = engines.get("sglang").kv_events_launch(argv, "10.0.0.5", 31001, 31003, "kv@r1", {}, ranks=2)
    config = json.loads(extra[1])
    assert extra[0] == "--kv-events-config" and config["publisher"] == "zmq" and config["topic"] == "kv@r1"
    assert config["endpoint"] == "tcp://*:31001" and config["replay_endpoint"] == "tcp://*:31003"  # SGLang binds *
    assert [r["endpoint"] for r in record["ranks"]] == ["tcp://10.0.0.5:31001", "tcp://10.0.0.5:31002"]
    assert [r["replay_endpoint"] for r in record["ranks"]] == ["tcp://10.0.0.5:31003", "tcp://10.0.0.5:31004"]
    assert (record["tokenizer"], record["hash_algo"]) == ("/tok", "sglang_sha256")


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-path", "/m"],  # its default page of one token: an event and a key per token
        ["--model-path", "/m", "--page-size", "8"],
        ["--model-path", "/m", "--page-size", "16", "--disable-radix-cache"],
        ["--model-path", "/m", "--page-size", "16", "--speculative-algorithm", "EAGLE"],  # pages keyed by token pairs
        ["--model-path", "/m", "--page-size", "16", "--kv-events-config", "{}"],  # the user's own publisher
    ],
)
def test_sglang_publishes_nothing_the_router_cannot_key_or_follow_cheaply(argv):
    assert engines.get("sglang").kv_events_launch(argv, "127.0.0.1", 1, 2, "t", {}) is None


ONE_HOST = Reservation("cpu", None, {}, 1)
TWO_HOSTS = Reservation("gpu", None, {}, 1, placement_bundles=[{"GPU": 4}, {"GPU": 4}])


def test_which_nodes_publish():
    vllm, llama = engines.get("vllm"), engines.get("llama_cpp")
    auto, on, off = (RoutingSpec.of("cache_aware", kv_events=v) for v in ("auto", True, False))
    assert _kv_events(vllm, auto, (1, 1, 1), ONE_HOST, "serve[0]")
    assert not _kv_events(vllm, off, (1, 1, 1), ONE_HOST, "serve[0]")
    # other policies too: a switch to cache_aware in place then finds the engines publishing
    assert _kv_events(vllm, RoutingSpec.of("least_load"), (1, 1, 1), ONE_HOST, "serve[0]")
    assert not _kv_events(llama, auto, (1, 1, 1), ONE_HOST, "serve[0]")  # auto: llama.cpp keeps the table
    # data-parallel engines of one replica publish a stream per rank, when they all run on its host
    assert _kv_events(vllm, on, (1, 1, 2), ONE_HOST, "serve[0]")
    assert _kv_events(vllm, auto, (4, 1, 1), TWO_HOSTS, "serve[0]")  # one engine core, on the first host
    assert not _kv_events(vllm, auto, (4, 1, 2), TWO_HOSTS, "serve[0]")
    with pytest.raises(ConfigError, match="data-parallel engines over several hosts"):
        _kv_events(vllm, on, (4, 1, 2), TWO_HOSTS, "serve[0]")
    with pytest.raises(ConfigError, match="llama.cpp publishes no KV-cache events"):
        _kv_events(llama, on, (1, 1, 1), ONE_HOST, "serve[0]")


def test_a_data_parallel_server_publishes_each_rank_on_the_ports_given_plus_its_rank():
    argv = ["--model", "/m", "--data-parallel-size", "3"]
    extra, record = engines.get("vllm").kv_events_launch(argv, "10.0.0.5", 31010, 31020, "kv@r1", {}, ranks=3)
    config = json.loads(extra[1])  # one config: vLLM offsets both ports by each engine core's DP rank
    assert config["endpoint"] == "tcp://*:31010" and config["replay_endpoint"] == "tcp://10.0.0.5:31020"
    assert record["endpoint"] == "tcp://10.0.0.5:31010"
    assert record["ranks"] == [
        {"endpoint": f"tcp://10.0.0.5:{31010 + r}", "replay_endpoint": f"tcp://10.0.0.5:{31020 + r}"} for r in range(3)
    ]
    _, single = engines.get("vllm").kv_events_launch(["--model", "/m"], "10.0.0.5", 31010, 31020, "kv@r1", {})
    assert single["ranks"] == [{"endpoint": "tcp://10.0.0.5:31010", "replay_endpoint": "tcp://10.0.0.5:31020"}]


def test_vllm_offsets_a_dp_ranks_ports_as_the_record_says():
    """The record's per-rank endpoints are where vLLM's own publisher binds rank r (offset_endpoint_port)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    offset = kv_events.ZmqEventPublisher.offset_endpoint_port
    _, record = engines.get("vllm").kv_events_launch(["--model", "/m"], "10.0.0.5", 31010, 31020, "t", {}, ranks=2)
    for rank, ends in enumerate(record["ranks"]):
        assert offset(record["endpoint"], rank) == ends["endpoint"]
        assert offset(record["replay_endpoint"], rank) == ends["replay_endpoint"]


def test_free_ports_reserves_a_run_of_consecutive_free_ports(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = free_ports("127.0.0.1", 4)
    assert all(port_is_free("127.0.0.1", first + i) for i in range(4))
    again = [free_ports("127.0.0.1", 4) for _ in range(5)]  # reserved: no run overlaps another
    taken = [set(range(p, p + 4)) for p in [first, *again]]
    assert all(not (a & b) for i, a in enumerate(taken) for b in taken[i + 1 :])


def test_every_engine_of_a_deployment_gets_one_block_hash_seed_from_its_secret(demo_model_path, tmp_path):
    """vLLM 0.26 draws the first block's parent at random without PYTHONHASHSEED (measured on the GPU recipe's
    build: no predicted hit on any request): the deployment gives its publishing engines one seed, the same on
    every `run`, and a seed of the user's wins."""
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.plan import build_plan
    from flagscale.serve.app import engine_spec

    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")

    def specs(envs=None, kv_events="auto"):
        node = {"engine": "vllm", "engine_args": {"model": str(demo_model_path), "max_model_len": 256}}
        nodes = [{"serve_id": name, **node, "routing_options": {"kv_events": kv_events}} for name in ("a", "b")]
        experiment = {"exp_name": "t", "exp_dir": str(tmp_path / "e"), "runner": {"deploy": {"port": 18998}}}
        plan = build_plan(load_config({"experiment": experiment | (envs or {}), "serve": nodes}, sources), sources)
        return [engine_spec(plan, e) for e in plan.engines]

    seeds = {spec.env["PYTHONHASHSEED"] for spec in specs()}
    assert len(seeds) == 1 and 0 <= int(seeds.pop()) < 2**32
    assert specs()[0].env["PYTHONHASHSEED"] == specs()[1].env["PYTHONHASHSEED"]  # the same on the next run
    assert {s.env["PYTHONHASHSEED"] for s in specs({"envs": {"PYTHONHASHSEED": "42"}})} == {"42"}
    assert all("PYTHONHASHSEED" not in s.env for s in specs(kv_events=False))
