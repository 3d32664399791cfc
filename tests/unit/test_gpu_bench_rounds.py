"""benchmarks/gpu/bench_gpu.py's round order and engine-side pace (issue 31, item 1: the TP=2 gap at 256 streams
was on the same side in every round with plain always first, and the client's TPOT could not tell the engine's
pace from the relay's)."""

from __future__ import annotations

import http.server
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "gpu")]
_saved_env = dict(os.environ)
import bench_gpu  # noqa: E402  (sets the GPU-safe variables in os.environ on import: put back below)

os.environ.clear()
os.environ.update(_saved_env)


def test_alternate_order_reverses_every_other_round_and_fixed_keeps_it():
    names = ["plain", "orchestrator", "replicas"]
    alternate = [bench_gpu.round_order(names, i, "alternate") for i in range(4)]
    assert alternate == [names, names[::-1], names, names[::-1]]
    assert all(bench_gpu.round_order(names, i, "fixed") == names for i in range(4))
    firsts = [order[0] for order in alternate]
    assert firsts.count("plain") == firsts.count("replicas") == 2  # nobody always goes first


def metrics_text(tpot_sum: float, tpot_count: int, itl_sum: float, itl_count: int) -> str:
    """vLLM's /metrics as it exposes the two histograms, one label set per engine (DP engines add more)."""
    lines = []
    for name, total, count in (
        ("vllm:request_time_per_output_token_seconds", tpot_sum, tpot_count),
        ("vllm:inter_token_latency_seconds", itl_sum, itl_count),
    ):
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        for engine, share in (("0", 0.5), ("1", 0.5)):
            labels = f'engine="{engine}",model_name="demo"'
            lines += [
                f'{name}_bucket{{{labels},le="+Inf"}} {count * share}',
                f"{name}_count{{{labels}}} {count * share}",
                f"{name}_sum{{{labels}}} {total * share}",
            ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def engine():
    """A real HTTP server that answers /metrics with whatever `state["text"]` holds."""
    state = {"text": metrics_text(0, 0, 0, 0)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = state["text"].encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def readings(urls: list[str]) -> list[dict[str, float] | None]:
    """A system's engines read as a pass reads them (read_engines), in `urls`' order, a URL listed twice read twice."""
    return [bench_gpu.read_engines([url])[url] for url in urls]


def test_engine_pace_is_the_mean_of_the_histograms_over_the_pass(engine):
    url, state = engine
    state["text"] = metrics_text(tpot_sum=1.0, tpot_count=100, itl_sum=2.0, itl_count=1000)
    before = bench_gpu.engine_sums(readings([url]))
    # the pass: 200 more requests at 15 ms per output token, 4,000 more gaps at 12.5 ms
    state["text"] = metrics_text(tpot_sum=1.0 + 3.0, tpot_count=300, itl_sum=2.0 + 50.0, itl_count=5000)
    pace = bench_gpu.engine_pace(before, bench_gpu.engine_sums(readings([url])))
    assert pace == {"engine TPOT mean ms": 15.0, "engine ITL mean ms": 12.5}


def test_engine_pace_sums_every_engine_of_a_system(engine):
    url, state = engine
    before = bench_gpu.engine_sums(readings([url, url]))  # two replicas' engines, each answering the same here
    state["text"] = metrics_text(tpot_sum=2.0, tpot_count=200, itl_sum=1.0, itl_count=100)
    after = bench_gpu.engine_sums(readings([url, url]))
    assert after["vllm:request_time_per_output_token_seconds_count"] == 400
    assert bench_gpu.engine_pace(before, after)["engine TPOT mean ms"] == 10.0


def test_no_engine_pace_without_engines_an_answer_or_a_finished_request(engine):
    url, _ = engine
    assert bench_gpu.engine_sums([]) is None
    assert bench_gpu.engine_sums(readings([url, "http://127.0.0.1:9"])) is None  # one engine silent: no partial pace
    unknown = {"engine TPOT mean ms": None, "engine ITL mean ms": None}
    assert bench_gpu.engine_pace(None, bench_gpu.engine_sums(readings([url]))) == unknown
    same = bench_gpu.engine_sums(readings([url]))
    assert bench_gpu.engine_pace(same, same) == unknown  # nothing finished during the pass


def test_engine_urls_per_kind_of_system():
    plain = SimpleNamespace(url="http://127.0.0.1:8600")  # a plain server: its own URL
    assert bench_gpu.engine_urls(plain, "vllm") == ["http://127.0.0.1:8600"]
    assert bench_gpu.engine_urls(plain, "sglang") == []  # other names for its histograms
    routed = object.__new__(bench_gpu.RoutedPlainServers)  # its servers, not the vllm-router in front
    routed.servers = [SimpleNamespace(url=f"http://127.0.0.1:{port}") for port in (8603, 8604)]
    routed.url = "http://127.0.0.1:8601"
    assert bench_gpu.engine_urls(routed, "vllm") == ["http://127.0.0.1:8603", "http://127.0.0.1:8604"]
    orch = object.__new__(bench_gpu.Orch)  # its replicas' engines, as status listed them before the load
    orch.replica_urls = {"r1": "http://127.0.0.1:8701", "r2": "http://127.0.0.1:8702"}
    assert bench_gpu.engine_urls(orch, "vllm") == ["http://127.0.0.1:8701", "http://127.0.0.1:8702"]


def test_each_replicas_counters_come_from_the_one_reading_of_its_engine():
    orch = object.__new__(bench_gpu.Orch)
    orch.replica_urls = {"r1": "http://127.0.0.1:8701", "r2": "http://127.0.0.1:8702"}
    reading = {bench_gpu.REQUESTS_METRIC: 7.0, bench_gpu.TOKENS_METRIC: 700.0}
    counters = orch.engine_counters({"http://127.0.0.1:8701": reading, "http://127.0.0.1:8702": None})
    assert counters == {"r1": {"requests": 7.0, "tokens": 700.0}}  # r2's engine did not answer: left out


def bench_result(starts: list[float], ttft: float = 0.1, itl: float = 0.01, tokens: int = 3) -> dict:
    """One client's `vllm bench serve` result with requests that began at `starts` (perf_counter seconds)."""
    n = len(starts)
    return {
        "start_times": starts,
        "ttfts": [ttft] * n,
        "itls": [[itl] * (tokens - 1)] * n,
        "latencies": [ttft + itl * (tokens - 1)] * n,
        "output_lens": [tokens] * n,
        "errors": [""] * n,
        "total_output_tokens": tokens * n,
        "completed": n,
        "failed": 0,
        "duration": max(starts) - min(starts) + ttft + itl * (tokens - 1),
        "output_throughput": 1.0,
        "request_throughput": 1.0,
        **{f"{stat}_{m}_ms": 1.0 for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "p50", "p90", "p99")},
    }


def test_pooled_row_reports_how_far_apart_the_clients_began():
    row = bench_gpu.pooled_row(2, 2, [bench_result([10.0, 10.5]), bench_result([13.0, 13.2])])
    assert row["client_start_skew_s"] == pytest.approx(3.0)
    assert row["span_s"] == pytest.approx(13.2 + 0.12 - 10.0)  # the late client's start is in the span
    assert bench_gpu.pooled_row(2, 1, [bench_result([10.0])])["client_start_skew_s"] is None


def test_the_all_clients_window_counts_only_what_streamed_while_every_client_ran():
    # client A: requests at 10.0 and 10.5; client B at 13.0 and 13.2 (3 tokens: TTFT 0.1, then 0.01 apart)
    early, late = bench_result([10.0, 10.5, 13.1]), bench_result([13.0, 13.2])
    seconds, tokens, tpots = bench_gpu.all_clients_on([early, late])
    assert seconds == pytest.approx(13.1 + 0.12 - 13.0)  # B's first start to A's last end
    assert tokens == pytest.approx(3 + 3)  # A's 13.1 request and B's 13.0 one (B's 13.2 one streams after 13.22)
    assert tpots == [pytest.approx(0.01), pytest.approx(0.01)]  # the two requests wholly inside
    row = bench_gpu.pooled_row(2, 2, [early, late])
    assert row["all_on_tok_s"] == pytest.approx(6 / 0.22) and row["all_on_tpot_ms"]["p50"] == pytest.approx(10.0)
    assert bench_gpu.all_clients_on([bench_result([1.0]), bench_result([5.0])]) == (0.0, 0.0, [])  # no overlap


def test_the_round_line_flags_a_busy_client_and_a_skewed_start():
    calm = {"client_cpu_cores": [0.3, 0.41], "client_start_skew_s": 0.05, "span_s": 20.0}
    assert bench_gpu.client_note(calm) == "  client 0.41 cores"
    busy = {"client_cpu_cores": [0.97, None], "client_start_skew_s": 3.0, "span_s": 7.6}
    note = bench_gpu.client_note(busy)
    assert "client 0.97 cores" in note and "client-bound" in note and "3.0 s apart" in note
    skewed = {**busy, "all_on_s": 4.0, "all_on_tok_s": 900.0, "all_on_tpot_ms": {"p50": 9.5}}
    assert "(all on 4.0 s: 900.0 tok/s, TPOT p50 9.50 ms)" in bench_gpu.client_note(skewed)
    assert bench_gpu.client_note({}) == ""


def test_the_medians_carry_the_busiest_client_per_pass():
    def row(cores):
        return {
            **bench_gpu.pooled_row(1, 2, [bench_result([1.0]), bench_result([1.0])]),
            "cpu_s": {},
            "client_cpu_cores": cores,
            "router_us_per_token": None,
            "engine_pace": {},
        }

    rounds = [{"plain": {"1": row([0.2, 0.9])}}, {"plain": {"1": row([0.5, 0.1])}}, {"plain": {"1": row([None])}}]
    assert bench_gpu.median_rows(rounds, "plain", 1)["busiest client cores"] == pytest.approx(0.7)
