"""The embedded demo model: a tiny random-weight Llama and a byte-level BPE tokenizer, made locally.

Nothing is downloaded. Generation is deterministic: the same seed gives the same files, so the cache
directory is keyed by the seed and the shape, and a finished model is marked by a `.complete` file.
The same model as one GGUF file (for engine: llama_cpp) is converted from it on first use by the converter of the
llama.cpp built here (flagscale/engines/llama_cpp_build.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from flagscale.adaptors import safetensors_torch, tokenizers, torch, transformers
from flagscale.engines import llama_cpp_build
from flagscale.paths import default_cache_dir
from flagscale.progress import waiting

DEMO_SEED = 1234
# head_dim = hidden / heads = 64: vLLM's CPU attention does not support head_dim 16.
DEMO_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]


def _training_corpus() -> list[str]:
    # A fixed, varied text so the tokenizer learns merges; only determinism matters, not quality.
    words = (
        "the quick brown fox jumps over a lazy dog while serving engineers measure tokens per second "
        "ray serve routes requests to vllm engines on many hosts and chips prefill decode cache "
        "hello world what is the capital of france paris berlin tokyo one two three four five "
        "system user assistant content role message stream chunk model completion chat"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def demo_model_dir(seed: int = DEMO_SEED, cache_dir: Path | None = None) -> Path:
    key = hashlib.sha256(json.dumps({"seed": seed, **DEMO_SHAPE}, sort_keys=True).encode()).hexdigest()[:12]
    return (cache_dir or default_cache_dir()) / f"demo-llama-{key}"


def _train_tokenizer(out_dir: Path) -> None:
    models, pre_tokenizers, decoders = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.decoders
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=DEMO_SHAPE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _write_weights(out_dir: Path, seed: int) -> None:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        **DEMO_SHAPE,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def materialize(target: Path, build: Callable[[Path], None], what: str = "building a model (once)") -> Path:
    """A model directory built once: `build` fills a staging directory, which is renamed into place when complete
    (marked by `.complete`); when another process finishes first, its directory is kept. `what` is shown while
    `build` runs (on a terminal: flagscale/progress.py)."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with waiting(what):
            build(staging)
        (staging / ".complete").write_text("ok\n")
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_demo_model(seed: int = DEMO_SEED, cache_dir: Path | None = None) -> Path:
    """Return the demo model directory, generating it on first use."""

    def build(staging: Path) -> None:
        _train_tokenizer(staging)
        _write_weights(staging, seed)

    return materialize(demo_model_dir(seed, cache_dir), build, "generating the demo model (tokenizer + weights, once)")


# A LoRA adapter of a Llama-form model (the demo model, or benchmarks/gpu/model.py's random-weight Llamas): PEFT's
# layout (adapter_config.json + adapter_model.safetensors) for the attention projections, with random A and B (B
# nonzero, so the adapter's answers differ from the base model's).
DEMO_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each attention projection of a Llama-form model's config.json: k/v project to the
    key-value heads (grouped-query attention), q/o keep the hidden size."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = head_dim * config.get("num_key_value_heads", config["num_attention_heads"])
    return {"q_proj": (hidden, head_dim * config["num_attention_heads"]), "k_proj": (hidden, kv),
            "v_proj": (hidden, kv), "o_proj": (head_dim * config["num_attention_heads"], hidden)}  # fmt: skip


def lora_dir(base: Path, name: str, rank: int = 8) -> Path:
    """Where the adapter `name` of the model directory `base` lives: beside it, keyed by name, rank and base."""
    key = hashlib.sha256(json.dumps({"name": name, "rank": rank, "base": base.name}).encode()).hexdigest()[:12]
    return base.with_name(f"{base.name}-lora-{key}")


def ensure_lora(base: Path, name: str, rank: int = 8) -> Path:
    """A rank-`rank` LoRA adapter of the model in `base` (its config.json gives the shapes), generated on first use,
    its weights seeded by `name`."""

    def build(staging: Path) -> None:
        _write_lora(staging, base, name, rank)

    return materialize(lora_dir(base, name, rank), build, f"generating the LoRA adapter {name!r} (once)")


def demo_lora_dir(name: str, rank: int = 8, cache_dir: Path | None = None) -> Path:
    return lora_dir(demo_model_dir(DEMO_SEED, cache_dir), name, rank)


def ensure_demo_lora(name: str, rank: int = 8, cache_dir: Path | None = None) -> Path:
    """A rank-`rank` LoRA adapter of the demo model, generated on first use (its weights seeded by `name`)."""
    return ensure_lora(ensure_demo_model(DEMO_SEED, cache_dir), name, rank)


def _write_lora(out_dir: Path, base: Path, name: str, rank: int) -> None:
    generator = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    config = json.loads((base / "config.json").read_text())
    shapes = lora_module_shapes(config)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in DEMO_LORA_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
    safetensors_torch.save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(DEMO_LORA_MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


# The demo tokenizer's pre-tokenizer is byte-level BPE with GPT-2's split pattern (pre_tokenizers.ByteLevel), which
# llama.cpp calls "gpt-2"; its converter knows pre-tokenizers only by a hash of known models' tokenizations.
DEMO_GGUF_PRE_TOKENIZER = "gpt-2"
GGUF_CONVERT_TIMEOUT_S = 600


def demo_model_gguf_path(seed: int = DEMO_SEED, cache_dir: Path | None = None) -> Path:
    hf_dir = demo_model_dir(seed, cache_dir)
    return hf_dir.with_name(hf_dir.name + "-gguf") / "model.gguf"


def ensure_demo_model_gguf(seed: int = DEMO_SEED, cache_dir: Path | None = None) -> Path:
    """The demo model as one GGUF file (float32), converted on first use; needs llama.cpp built (make llama-cpp)."""
    hf_dir = ensure_demo_model(seed, cache_dir)
    converter = llama_cpp_build.converter_dir()
    if not (converter / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(
            f"llama.cpp's converter is not here ({converter}): run `make llama-cpp` to build llama.cpp first"
        )
    target = demo_model_gguf_path(seed, cache_dir)

    def build(staging: Path) -> None:
        argv = [sys.executable, "-m", "flagscale.demo_model", "to-gguf", str(converter), str(hf_dir)]
        subprocess.run([*argv, str(staging / target.name)], check=True, timeout=GGUF_CONVERT_TIMEOUT_S)

    return materialize(target.parent, build, "converting the demo model to GGUF (once)") / target.name


def _convert_to_gguf(converter: Path, hf_dir: Path, out: Path, outtype: str = "f32") -> None:
    """llama.cpp's convert_hf_to_gguf.py run in this process, told the demo tokenizer's pre-tokenizer (any model
    with the demo tokenizer: benchmarks/gpu/model.py's random-weight Llamas too, in f16 there)."""
    sys.path[:0] = [str(converter / "gguf-py"), str(converter)]
    # both from the converter's directories, which the line above put on sys.path
    import convert_hf_to_gguf
    from conversion.base import TextModel  # (likewise)

    TextModel.get_vocab_base_pre = lambda self, tokenizer: DEMO_GGUF_PRE_TOKENIZER
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["to-gguf"]:  # to-gguf CONVERTER HF_DIR OUT [OUTTYPE]
        _convert_to_gguf(*(Path(arg) for arg in sys.argv[2:5]), *sys.argv[5:6])
    elif sys.argv[1:2] == ["gguf"]:
        print(ensure_demo_model_gguf())
    else:
        print(ensure_demo_model())
