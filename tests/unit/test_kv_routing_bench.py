"""benchmarks/kv_routing.py's pure parts (traces, cache sizing, the oracle's trace, targets) and
benchmarks/fixed_router.py's file stand-in for the GCS's key-value store."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import fixed_router  # noqa: E402
import kv_events_bench  # noqa: E402
import kv_routing  # noqa: E402


def test_block_keys_are_a_chain_of_full_blocks():
    a = kv_routing.block_keys(list(range(10)), 4)
    b = kv_routing.block_keys([*range(8), 99, 98, 97, 96], 4)
    assert len(a) == 2 and len(b) == 3  # a trailing partial block is not a key
    assert a == b[:2]  # equal prefixes, equal keys
    assert kv_routing.block_keys([9, *range(1, 8)], 4)[1] != a[1]  # a block's key depends on what precedes it


def test_oracle_trace_counts_output_blocks_and_prompt_tokens():
    trace = kv_routing.oracle_trace([list(range(10))], block_size=4, output_len=7)
    keys, stored, tokens = trace[0]
    assert len(keys) == 2 and tokens == 10
    assert stored == [("output", 0, 2), ("output", 0, 3)]  # 17 tokens fill blocks 2 and 3


def test_simulate_reuses_at_most_the_prompt_less_its_last_token():
    keys = [1, 2]
    trace = [(keys, [], 8), (keys, [], 8)]  # whole blocks: the engine recomputes the last one
    result = kv_events_bench.simulate(trace, replicas=2, cache_blocks=10, block_tokens=4)
    assert result["oracle_hit_rate"] == pytest.approx(4 / 16)
    assert result["requests_per_replica"] == [2, 0]  # the second request goes where its prefix is


def test_simulate_evicts_least_recently_used():
    trace = [([1, 2], [], 9), ([3, 4], [], 9), ([1, 2], [], 9)]
    result = kv_events_bench.simulate(trace, replicas=1, cache_blocks=2, block_tokens=4)
    assert result["oracle_hit_rate"] == 0  # [1, 2] were evicted by [3, 4]


def test_simulate_empties_a_replica_where_an_engine_was_replaced():
    trace = [([1, 2], [], 9)] * 3
    whole = kv_events_bench.simulate(trace, replicas=1, cache_blocks=10, block_tokens=4)
    emptied = kv_events_bench.simulate(trace, replicas=1, cache_blocks=10, block_tokens=4, emptied={2: 0})
    assert whole["oracle_hit_rate"] == pytest.approx(16 / 27, abs=1e-4)
    assert emptied["oracle_hit_rate"] == pytest.approx(8 / 27, abs=1e-4)  # the third request finds nothing


def test_the_table_model_routes_where_it_sent_and_forgets_at_a_restart():
    a, b, c = ([1, 2], [], 9), ([3, 4], [], 9), ([5, 6], [], 9)
    trace = [a, b, c, c]  # a and c to replica 0, b to 1 (least used first); then c again
    oracle = kv_events_bench.simulate(trace, replicas=2, cache_blocks=10, block_tokens=4)["oracle_hit_rate"]
    table = kv_events_bench.simulate_table(trace, 2, 10, 4, None, forgotten=set())
    restarted = kv_events_bench.simulate_table(trace, 2, 10, 4, None, forgotten={3})
    assert oracle == table == pytest.approx(8 / 36, abs=1e-4)
    assert restarted == 0  # forgotten: c goes to the least used replica, 1, which never had it


def test_drive_pauses_at_each_break_in_order_and_takes_the_new_urls():
    import asyncio

    from aiohttp import web

    seen: list[tuple[str, int]] = []

    async def scenario():
        async def completions(request):
            body = await request.json()
            seen.append((request.host, int(body["prompt"])))
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        ports = []
        for _ in range(2):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])
        first, second = [f"http://127.0.0.1:{p}" for p in ports]
        actions: list[str] = []
        breaks = [(0.5, lambda: actions.append("router") or [second]), (0.75, lambda: actions.append("engine"))]
        args = kv_routing.parse_args(["--concurrency", "2", "--pass-s", "60"])
        result = await kv_routing.drive([first], [str(n) for n in range(8)], args, breaks)
        await runner.cleanup()
        return result, actions, first, second

    result, actions, first, second = asyncio.run(scenario())
    assert actions == ["router", "engine"] and result["broke_at"] == [4, 6] and result["issued"] == 8
    hosts = {n: host for host, n in seen}
    assert {hosts[n] for n in range(4)} == {first[7:]} and {hosts[n] for n in range(4, 8)} == {second[7:]}


def test_the_old_oracle_gives_what_it_gave():
    assert kv_events_bench.oracle(2, 64, 32, 8, 2000, 0)["oracle_hit_rate"] == 0.5756


def test_cache_sizing_makes_the_working_set_outgrow_one_engine_but_fit_all():
    blocks = kv_routing.cache_blocks_for([5] * 8, engines=2, fill=1.5, floor_blocks=3)
    assert 40 > blocks and 2 * blocks >= 40
    assert kv_routing.cache_blocks_for([1], engines=4, fill=1.5, floor_blocks=17) == 17


def test_traces_are_the_same_for_the_same_seed_and_zipf_favours_the_first():
    args = kv_routing.parse_args(["--requests", "400", "--customers", "10"])
    one = kv_routing.shared_prefix_trace(args, 3, 1.0)
    assert one == kv_routing.shared_prefix_trace(args, 3, 1.0)
    picks = kv_routing.zipf_picks(random.Random(0), 10, 2000, 1.0)
    assert picks.count(0) > 3 * picks.count(9)
    assert len(set(p.split(" ")[0] for p in kv_routing.random_trace(args, 0, 1.0))) == 200  # nothing shared


def test_parse_args_takes_the_gpu_sizes_with_gpu():
    gpu = kv_routing.parse_args(["--gpu", "--engines", "3"])
    assert (gpu.engines, gpu.block_size, gpu.size) == (3, 16, "8b")
    assert kv_routing.parse_args([]).engines == 2


def _row(workload, system, **values):
    base = {"hit_rate": 0.5, "oracle_hit_rate": 0.52, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "output_tok_s": 100}
    return {"workload": workload, "system": system, "failed": 0, **base, **values}


def test_targets_judge_the_kv_events_system():
    rows = [
        _row("a", "kv_events", output_tok_s=250),
        _row("a", "round_robin", hit_rate=0.1, output_tok_s=100),
        _row("c", "kv_events", ttft_p50_ms=13.0, output_tok_s=99),
        _row("c", "table", ttft_p50_ms=10.0),
        _row("d", "kv_events", ttft_p90_ms=10.0, table_model_hit_rate=0.47),
        _row("d", "table", hit_rate=0.45),
    ]
    found = {(t["workload"], t["target"][:12]): t["met"] for t in kv_routing.targets(kv_routing.medians(rows))}
    assert found[("a", "hit rate wit")] is True
    assert found[("a", ">= 2x round_")] is True
    assert found[("c", ">= 0.98x the")] is False  # +3 ms TTFT p50
    assert found[("d", ">= 1.2x the ")] is True  # P90 TTFT 0.5x
    assert found[("e", ">= 1.2x the ")] is None  # not run
    reach = [t["shown"] for t in kv_routing.targets(kv_routing.medians(rows)) if t["target"].startswith(">= 1.2x")][0]
    assert "the oracle's hit rate: 1.11x the table's at its best" in reach  # 0.52 / 0.47
    assert "| a | kv_events |" in kv_routing.markdown(
        kv_routing.medians(rows), kv_routing.targets(kv_routing.medians(rows))
    )


def test_the_prefill_systems_route_cache_aware_weighing_prefill_and_are_judged_too():
    engines = argparse.Namespace(
        urls=["http://a", "http://b"], kv_events=[{"endpoint": "tcp://a:1"}, None], devices=[{"gpus": ["0"]}] * 2
    )
    args = argparse.Namespace(settle_s=0.0, balance_abs_threshold=16)
    for system, kv_events, balance_by, scope in (
        ("kv_prefill", True, "prefill", None),
        ("table", False, None, None),
        ("kv_replica", True, None, "replica"),
    ):
        group = kv_routing.RouterGroup(system, 1, engines, None, Path("/nowhere"), args)
        config = json.loads(group.argv(1234, None)[-1])
        routing = config["routing"][kv_routing.MODEL]
        assert routing["policy"] == "cache_aware" and routing["settings"]["kv_events"] is kv_events
        assert routing["settings"].get("balance_by") == balance_by
        assert routing["settings"].get("balance_scope") == scope
        assert routing["settings"]["balance_abs_threshold"] == 16
        # the engines share GPU 0, as their records say to the router
        records = fixed_router.records("app", config["replicas"], [kv_routing.MODEL])
        assert [r.gpus for r in records] == [["0"], ["0"]] and records[0].node_id == records[1].node_id
    rows = [_row("a", "kv_prefill", output_tok_s=250), _row("a", "round_robin", output_tok_s=100)]
    found = kv_routing.targets(kv_routing.medians(rows), "kv_prefill")
    assert {t["system"] for t in found} == {"kv_prefill"}
    assert next(t for t in found if t["target"].startswith(">= 2x"))["met"] is True
    assert "| a | kv_prefill |" in kv_routing.markdown(kv_routing.medians(rows), found)


def test_medians_sum_failures_over_rounds():
    rows = [_row("a", "table", failed=1, hit_rate=0.2), _row("a", "table", failed=2, hit_rate=0.4)]
    meds = kv_routing.medians(rows)["a"]["table"]
    assert meds["failed"] == 3 and meds["hit_rate"] == pytest.approx(0.3)


def test_file_kv_stands_in_for_the_gcs(tmp_path):
    kv = fixed_router.FileKV(tmp_path)
    kv.put(b"routers/app/h:1", b"one", namespace="ns")
    kv.put(b"routers/app/h:2", b"two", namespace="ns")
    kv.put(b"router-drain/app", b"x", namespace="ns")
    assert sorted(kv.list(b"routers/app/", "ns")) == [b"routers/app/h:1", b"routers/app/h:2"]
    assert kv.get(b"routers/app/h:1", "ns") == b"one" and kv.get(b"nothing", "ns") is None
    kv.delete(b"routers/app/h:1", "ns")
    assert kv.list(b"routers/app/", "ns") == [b"routers/app/h:2"]


def test_fixed_records_carry_the_kv_events_endpoints():
    records = fixed_router.records("app", [{"url": "http://a", "kv_events": {"endpoint": "tcp://a:1"}}], ["demo"])
    assert records[0].replica_id == "r0" and records[0].kv_events == {"endpoint": "tcp://a:1"}


def test_kv_cache_bytes_hold_the_blocks_of_the_model(tmp_path):
    """Engines started together get their KV cache in bytes (no profiling of a GPU another engine is filling):
    room for every block of an 8B shape (2 MiB a 16-token block in bf16), not much more."""
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = kv_routing.kv_cache_bytes(tmp_path, 1000, 16)
    assert 1000 * (2 << 20) <= got <= 1000 * (2 << 20) * 1.2 + (256 << 20)
    in_float32 = kv_routing.kv_cache_bytes(tmp_path, 1000, 16, 4)  # CPU engines: twice the bytes a block
    assert 1000 * (4 << 20) <= in_float32 <= 1000 * (4 << 20) * 1.2 + (256 << 20)


def test_engines_are_dealt_over_the_visible_gpus():
    assert [kv_routing.engine_device(i, 2, None) for i in range(4)] == ["0", "1", "0", "1"]
    assert [kv_routing.engine_device(i, 2, "3, 5,7") for i in range(3)] == ["3", "5", "3"]
    with pytest.raises(SystemExit, match="--gpus 4: only 2 visible"):
        kv_routing.engine_device(0, 4, "0,1")
