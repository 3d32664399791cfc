"""benchmarks/lora_bench.py's pure parts (issue 52's benchmark, CPU and GPU) and flagscale/demo_model.py's LoRA
adapters of any Llama-form base: the shapes of grouped-query attention, B nonzero, the base named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flagscale.adaptors import safetensors_torch
from flagscale.demo_model import demo_lora_dir, demo_model_dir, ensure_lora, lora_dir, lora_module_shapes
from flagscale.devices.nvidia import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import lora_bench  # noqa: E402

LLAMA_1B = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 16}


def test_module_shapes_follow_grouped_query_attention():
    shapes = lora_module_shapes(LLAMA_1B)
    assert shapes == {"q_proj": (2048, 2048), "k_proj": (2048, 512), "v_proj": (2048, 512), "o_proj": (2048, 2048)}
    demo = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    assert set(lora_module_shapes(demo).values()) == {(128, 128)}
    assert lora_module_shapes({**LLAMA_1B, "head_dim": 128})["k_proj"] == (2048, 1024)


def test_an_adapter_of_a_gqa_base_has_its_shapes_a_nonzero_b_and_names_its_base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (base / "config.json").write_text(json.dumps(config))
    path = ensure_lora(base, "one", rank=4)
    assert path == lora_dir(base, "one", 4) and path != lora_dir(base, "two", 4) != lora_dir(base, "one", 8)
    tensors = safetensors_torch.load_file(str(path / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 4 * 2
    prefix = "base_model.model.model.layers.1.self_attn"
    assert tuple(tensors[f"{prefix}.k_proj.lora_A.weight"].shape) == (4, 64)
    assert tuple(tensors[f"{prefix}.k_proj.lora_B.weight"].shape) == (32, 4)
    assert tuple(tensors[f"{prefix}.o_proj.lora_B.weight"].shape) == (64, 4)
    assert all(t.abs().sum() > 0 for t in tensors.values())
    adapter_config = json.loads((path / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base) and adapter_config["r"] == 4
    assert ensure_lora(base, "one", rank=4) == path  # generated once


def test_the_demo_adapters_keep_their_cache_directories():
    base = demo_model_dir()
    assert demo_lora_dir("a") == lora_dir(base, "a") and demo_lora_dir("a").parent == base.parent


def test_cpu_defaults_are_the_documented_run_and_gpu_ones_the_issue_benchmark():
    cpu = lora_bench.parse_args([])
    assert (cpu.requests, cpu.concurrency, cpu.tokens, cpu.input_len) == (400, 16, 16, 0)
    assert cpu.workloads == ["zipf"] and cpu.max_cpu_loras == 50 and cpu.warmup == 100 and cpu.pass_max_s == 0
    assert cpu.max_loras == 4
    gpu = lora_bench.parse_args(["--gpu"])
    assert (gpu.concurrency, gpu.tokens, gpu.input_len, gpu.rounds) == (64, 128, 256, 2)
    assert gpu.workloads == ["zipf", "hot"] and gpu.max_cpu_loras == 50 and gpu.warmup == 64 and gpu.max_loras == 16
    assert lora_bench.parse_args(["--gpu", "--concurrency", "128", "--max-cpu-loras", "20"]).max_cpu_loras == 20
    assert lora_bench.parse_args(["--hot"]).workloads == ["hot"]
    assert lora_bench.parse_args(["--max-loras", "6", "--max-cpu-loras", "2"]).max_cpu_loras == 6


def test_gpu_layout_one_engine_per_gpu_or_shared_at_0_4():
    assert lora_bench.gpu_layout(2, 2, False) == [("0", 0.85), ("1", 0.85)]
    assert lora_bench.gpu_layout(2, 2, True) == [("0", 0.4), ("0", 0.4)]
    assert lora_bench.gpu_layout(3, 2, False) == [("0", 0.4), ("1", 0.85), ("0", 0.4)]
    assert lora_bench.gpu_layout(4, 1, True) == [("0", 0.212)] * 4


def test_gpu_engine_args_and_env():
    args = lora_bench.parse_args(["--gpu", "--rank", "16"])
    argv = lora_bench.engine_argv(Path("/m"), 8000, args, 0.4)
    assert "--enforce-eager" in argv and "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and argv[argv.index("--max-cpu-loras") + 1] == "50"
    assert argv[argv.index("--max-loras") + 1] == "16"
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert int(argv[argv.index("--max-model-len") + 1]) >= 256 + 128
    env = lora_bench.engine_env(1, args, "1")
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and MULTICAST_OFF.items() <= env.items()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    cpu_env = lora_bench.engine_env(1, lora_bench.parse_args([]), "1")
    assert "CUDA_VISIBLE_DEVICES" not in cpu_env and "VLLM_CPU_OMP_THREADS_BIND" in cpu_env


def test_workload_is_zipf_and_the_hot_one_turns_the_coldest_adapter_hot():
    names = [f"a{i}" for i in range(10)]
    picks = lora_bench.workload(names, 1000, 1.1, False, seed=0)
    assert picks == lora_bench.workload(names, 1000, 1.1, False, seed=0)
    assert picks.count("a0") > picks.count("a4") > picks.count("a9")
    hot = lora_bench.workload(names, 1000, 1.1, True, seed=0)
    assert hot[:500] == picks[:500] and hot[500::2] == ["a9"] * 250 and hot[501::2] == picks[501::2]


def test_router_metrics_are_read_per_adapter():
    text = (
        "# HELP flagscale_router_adapter_loads_total x\n"
        'flagscale_router_adapter_loads_total{model="zipf-00"} 3.0\n'
        'flagscale_router_adapter_loads_total{model="zipf-07"} 11.0\n'
        'flagscale_router_adapter_evictions_total{model="zipf-00"} 2.0\n'
        'flagscale_router_adapter_loads_created{model="zipf-00"} 1.7e9\n'
    )
    assert lora_bench.parse_adapter_counts(text) == {
        "loads": {"zipf-00": 3, "zipf-07": 11},
        "evictions": {"zipf-00": 2},
    }


def test_targets_placed_against_oblivious_and_plain_per_replica():
    def row(tok, p90, per_replica=None):
        return [{"output_tok_s": tok, "ttft_p90_s": p90, "output_tok_s_per_replica": per_replica or tok}]

    results = {"zipf/placed": row(260, 2.0, 130), "zipf/oblivious": row(200, 3.0, 100), "zipf/plain": row(120, 1)}
    summary = lora_bench.summarize(results)
    verdict = lora_bench.targets(summary, "zipf")
    assert verdict == {
        "tok_s_vs_oblivious": 1.3,
        "ttft_p90_vs_oblivious": 0.67,
        "per_replica_vs_plain": 1.08,
        "met": True,
    }
    slower_than_plain = lora_bench.targets(lora_bench.summarize({**results, "zipf/plain": row(140, 1)}), "zipf")
    assert slower_than_plain["met"] is False
    assert lora_bench.targets(summary, "hot")["met"] is None


@pytest.mark.parametrize("input_len", [0, 40])
def test_prompts_are_distinct_and_about_input_len_tokens(input_len):
    from tokenizers import Tokenizer

    from flagscale.demo_model import ensure_demo_model

    model = ensure_demo_model()
    prompts = lora_bench.make_prompts(model, 5, input_len, seed=0)
    assert len(set(prompts)) == 5
    if input_len:
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        assert all(abs(len(tokenizer.encode(p).ids) - input_len) <= 3 for p in prompts)


def test_pass_sets_interleave_the_workloads_so_a_budget_cut_keeps_each():
    assert lora_bench.schedule(["zipf", "hot"], 2, 1) == [("zipf", 0), ("hot", 0), ("zipf", 1)]
    assert lora_bench.schedule(["hot"], 2, 1) == [("hot", 0)]
    assert lora_bench.schedule(["zipf"], 3, 1) == [("zipf", 0), ("zipf", 1), ("zipf", 2)]
    gpu = lora_bench.parse_args(["--gpu"])
    assert (
        gpu.budget_s == 400 and gpu.pass_max_s == 30 and gpu.requests == 256 and lora_bench.parse_args([]).budget_s == 0
    )


def test_an_open_loop_runs_each_workload_at_each_rate_and_judges_plain_on_its_tail():
    args = lora_bench.parse_args(["--gpu", "--rates", "3", "5.5"])
    assert args.workloads == ["zipf@3", "zipf@5.5", "hot@3", "hot@5.5"]
    with_closed = lora_bench.parse_args(["--gpu", "--rates", "0", "4", "--workloads", "zipf"])
    assert with_closed.workloads == ["zipf", "zipf@4"]  # rate 0: the closed loop too
    assert lora_bench.split_kind("zipf@5.5") == ("zipf", 5.5) and lora_bench.split_kind("hot") == ("hot", None)
    assert lora_bench.schedule(["zipf@3", "hot@3"], 2, 1) == [("zipf@3", 0), ("hot@3", 0), ("zipf@3", 1)]

    def row(tok, p90):
        return [{"output_tok_s": tok, "ttft_p90_s": p90, "output_tok_s_per_replica": tok / 2}]

    results = {"zipf@3/placed": row(380, 0.4), "zipf@3/oblivious": row(380, 1.0), "zipf@3/plain": row(190, 0.5)}
    verdict = lora_bench.targets(lora_bench.summarize(results), "zipf@3")
    assert verdict["ttft_p90_vs_oblivious"] == 0.4 and verdict["per_replica_vs_plain"] == 1.25 and verdict["met"]
    slower = lora_bench.targets(lora_bench.summarize({**results, "zipf@3/plain": row(190, 0.3)}), "zipf@3")
    assert slower["per_replica_vs_plain"] == 0.75 and slower["met"] is False
