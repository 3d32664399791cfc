"""`action=bench` helpers: vLLM's benchmark arguments and its result dict -> report rows. No server, no Ray."""

import json

import numpy as np

from flagscale.actions.bench import (
    LATENCY_METRICS,
    first_error,
    report_row,
    scalar_fields,
    tokenizer_for,
    vllm_bench_argv,
    write_plot,
)
from flagscale.config.load import load_config
from flagscale.config.schema import BenchConfig


def vllm_result(**overrides):
    """The shape of vllm.benchmarks.serve.main()'s return value for one pass (scalars are numpy floats there)."""
    result = {
        "duration": 12.5,
        "completed": 20,
        "failed": 0,
        "request_throughput": 1.6,
        "request_goodput": None,
        "output_throughput": 102.4,
        "total_token_throughput": 307.2,
        "max_concurrency": 4,
        "errors": ["", "", ""],
        "ttfts": [0.1, 0.2],
    }
    for i, metric in enumerate(LATENCY_METRICS):
        result[f"mean_{metric}_ms"] = np.float64(10.0 * (i + 1))
        result[f"median_{metric}_ms"] = np.float64(9.0 * (i + 1))
        result[f"std_{metric}_ms"] = np.float64(1.0)
        for p in (50, 90, 99):
            result[f"p{p}_{metric}_ms"] = np.float64(p + i)
    result.update(overrides)
    return result


def test_report_row_takes_throughput_and_percentiles():
    row = report_row(4, vllm_result())
    assert row["concurrency"] == 4 and row["completed"] == 20 and row["failed"] == 0
    assert row["output_tok_s"] == 102.4 and row["req_s"] == 1.6 and row["goodput_req_s"] is None
    assert row["ttft_ms"] == {"mean": 10.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert row["e2el_ms"]["p99"] == 102.0
    json.dumps(row)  # plain floats, not numpy


def test_goodput_and_errors():
    result = vllm_result(request_goodput=np.float64(0.8), failed=2, errors=["", "HTTP 503: no ready replica", "x"])
    assert report_row(16, result)["goodput_req_s"] == 0.8
    assert first_error(result) == "HTTP 503: no ready replica"
    assert first_error(vllm_result()) is None


def test_scalar_fields_drop_per_request_lists():
    fields = scalar_fields(vllm_result())
    assert "errors" not in fields and "ttfts" not in fields
    assert json.loads(json.dumps(fields))["p99_ttft_ms"] == 99.0


def test_argv_is_accepted_by_vllms_own_parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    settings = BenchConfig(
        num_prompts=7, input_len=32, output_len=8, slo_ttft_ms=500, slo_tpot_ms=50.5, endpoint="/v1/chat/completions"
    )
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(vllm_bench_argv("http://127.0.0.1:9", "demo", "/models/demo", settings, 3))
    assert args.backend == "openai-chat" and args.endpoint == "/v1/chat/completions"
    assert args.max_concurrency == 3 and args.num_prompts == 7 and args.dataset_name == "random"
    assert args.input_len == 32 and args.output_len == 8 and args.ignore_eos
    assert args.goodput == ["ttft:500", "tpot:50.5"]
    assert args.metric_percentiles == "50,90,99" and args.percentile_metrics == "ttft,tpot,itl,e2el"
    assert parser.parse_args(vllm_bench_argv("http://h", "m", "/t", BenchConfig(), 1)).goodput is None


def test_tokenizer_is_the_model_path_of_the_node_serving_the_name():
    config = load_config(
        {
            "experiment": {"exp_name": "t", "exp_dir": "/tmp/t"},
            "serve": [
                {"serve_id": "a", "engine": "vllm", "engine_args": {"model": "/m/a"}},
                {
                    "serve_id": "b",
                    "engine": "vllm",
                    "engine_args": {"model": "/m/b", "served_model_name": ["b1", "b2"]},
                },
                {"serve_id": "c", "engine": "vllm", "engine_args": {"model": "/m/c", "tokenizer": "/t/c"}},
            ],
        }
    )
    assert tokenizer_for(config, "a") == "/m/a"
    assert tokenizer_for(config, "b2") == "/m/b"
    assert tokenizer_for(config, "c") == "/t/c"
    assert tokenizer_for(config, "b") is None


def test_plot_is_written(tmp_path):
    rows = [report_row(c, vllm_result()) for c in (1, 4, 16)]
    write_plot(rows, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_each_benchmark_pass_gets_its_own_prompt_set_and_every_system_the_same_one():
    """benchmarks/overhead.py's pass_settings (parallel.py and llama_cpp.py use it too)."""
    import argparse

    from benchmarks.overhead import pass_settings

    args = argparse.Namespace(input_len=128, output_len=64, num_prompts=20)
    first = pass_settings(args, 0, 16)
    assert (first.input_len, first.output_len, first.num_prompts) == (128, 64, 20)
    assert pass_settings(args, 0, 16) == first
    assert len({pass_settings(args, r, c).seed for r in range(3) for c in (1, 16)}) == 6
