"""A random-weight Llama (or a Mixtral-form MoE, config only) of a chosen size, made locally (on the GPU when there is one) for benchmarks.

Weights are drawn directly as safetensors shards (normal(0, 0.02), norms 1), with vLLM's / transformers' Llama
tensor names and a model.safetensors.index.json, so no transformers model object is built: an 8B-class model
is written in well under a minute on a GPU. The tokenizer is the project's demo tokenizer (byte-level BPE,
vocab 512, trained locally by flagscale.demo_model). Nothing is downloaded. The directory is keyed by
size, shape and seed under the FlagScale cache and marked finished by a `.complete` file.

Without weights (`weights=False`, `--no-weights`) only config.json and the tokenizer are written: what vLLM's
`load_format: dummy` needs (it fills the weights with random values itself), so 8B-70B shapes start cheaply.

  python benchmarks/gpu/model.py --size 1b     # prints the model directory
  python benchmarks/gpu/model.py --size 8b --no-weights
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flagscale.demo_model import DEMO_SHAPE, _train_tokenizer, materialize  # noqa: E402
from flagscale.paths import default_cache_dir  # noqa: E402

VOCAB = DEMO_SHAPE["vocab_size"]  # the demo tokenizer's vocabulary: 512
SIZES: dict[str, dict[str, int]] = {
    # The demo model's shape (head_dim 64: vLLM's CPU attention needs it); for CPU smoke tests.
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    },
    # ../shared/anchor-figures.md (H100): 0.98 B parameters with vocab 512, 2 GB in bf16.
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # Llama-3-8B's body (vocab 512 instead of 128k): 6.98 B parameters, 14 GB in bf16.
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # Qwen2.5-7B's body in Llama form (vocab 512), its 32k context: 6.5 B parameters, 13 GB in bf16. The shape of
    # FlagScale's qwen2_5 example configs (tests/gpu/test_pd.py runs its xpyd config as it is on 4 GPUs).
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
    },
    # Qwen2.5-32B's body in Llama form (vocab 512): 31.2 B parameters, 62 GB in bf16; with --dummy-weights only.
    "32b": {
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    },
    # Mixture-of-experts shapes (Mixtral form: num_local_experts, top-2 routing) for expert parallel; with
    # --dummy-weights / --no-weights only (vLLM draws the weights). "moe-tiny": the demo model's body, 8 experts
    # (tests/gpu). "moe-3b": 16 experts of Llama-1B-like width, 3.4 B parameters (0.6 B active), 7 GB in bf16: the
    # expert-parallel benchmark's shape (multi_gpu.sh ep2 / ep4), 8 or 4 experts per GPU at DP=2 / 4.
    "moe-tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "moe-3b": {
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "num_experts_per_tok": 2,
    },
}
MAX_POSITIONS = 8192
SEED = 1234
SHARD_BYTES = 4 * 2**30


def shape_of(size: str) -> dict[str, int]:
    return {"vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, **SIZES[size]}


def is_moe(size: str) -> bool:
    return "num_local_experts" in SIZES[size]


def parameter_count(size: str) -> int:
    s = shape_of(size)
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    experts = s.get("num_local_experts", 1)
    per_layer = 2 * h * h + 2 * h * kv + experts * 3 * h * i + 2 * h + (h * experts if is_moe(size) else 0)
    return layers * per_layer + 2 * VOCAB * h + h


def model_dir(size: str, seed: int = SEED, cache_dir: Path | None = None, weights: bool = True) -> Path:
    key = hashlib.sha256(
        json.dumps({"seed": seed, "format": 1, **shape_of(size)}, sort_keys=True).encode()
    ).hexdigest()[:12]
    kind = "" if weights else "config-"  # config.json + tokenizer only: for vLLM's load_format dummy
    family = "mixtral" if is_moe(size) else "llama"
    return (cache_dir or default_cache_dir()) / f"bench-{family}-{size}-{kind}{key}"


def _tensor_shapes(size: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) in checkpoint order."""
    s = shape_of(size)
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (VOCAB, h), False)]
    for layer in range(s["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,), True),
            (p + "self_attn.q_proj.weight", (h, h), False),
            (p + "self_attn.k_proj.weight", (kv, h), False),
            (p + "self_attn.v_proj.weight", (kv, h), False),
            (p + "self_attn.o_proj.weight", (h, h), False),
            (p + "post_attention_layernorm.weight", (h,), True),
            (p + "mlp.gate_proj.weight", (i, h), False),
            (p + "mlp.up_proj.weight", (i, h), False),
            (p + "mlp.down_proj.weight", (h, i), False),
        ]
    out += [("model.norm.weight", (h,), True), ("lm_head.weight", (VOCAB, h), False)]
    return out


def _write_config(out_dir: Path, size: str) -> None:
    from transformers import LlamaConfig, MixtralConfig

    config_class, architecture = (
        (MixtralConfig, "MixtralForCausalLM") if is_moe(size) else (LlamaConfig, "LlamaForCausalLM")
    )
    config = config_class(
        **shape_of(size),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    config.architectures = [architecture]
    config.save_pretrained(out_dir)


def _write_weights(out_dir: Path, size: str, seed: int, device: str) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0
    shard_names: list[list[str]] = []  # tensor names of each shard written

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            save_file(shard, str(out_dir / f"shard-{len(shard_names)}.tmp"), metadata={"format": "pt"})
            shard_names.append(list(shard))
        shard, shard_bytes = {}, 0

    for name, shape, is_norm in _tensor_shapes(size):
        if is_norm:
            tensor = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=generator)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor.cpu()
        shard_bytes += nbytes
        total_bytes += nbytes
    flush()
    count = len(shard_names)
    files = [f"model-{n + 1:05d}-of-{count:05d}.safetensors" for n in range(count)]
    for n, file in enumerate(files):
        (out_dir / f"shard-{n}.tmp").rename(out_dir / file)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: files[n] for n, names in enumerate(shard_names) for name in names},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_model(
    size: str,
    seed: int = SEED,
    cache_dir: Path | None = None,
    device: str | None = None,
    log=print,
    weights: bool = True,
) -> Path:
    """The model directory for `size`, generated on first use (on `device`, default the GPU if there is one).
    `weights=False`: config.json and tokenizer only, for an engine that loads with `load_format: dummy`."""
    if weights and is_moe(size):
        raise ValueError(f"the {size} shape is written without weights only (--no-weights / --dummy-weights)")
    target = model_dir(size, seed, cache_dir, weights)
    if (target / ".complete").exists():
        return target
    device = (device or default_device()) if weights else "-"
    started = time.monotonic()

    def build(staging: Path) -> None:
        _train_tokenizer(staging)
        _write_config(staging, size)
        if weights:
            _write_weights(staging, size, seed, device)

    materialize(target, build)
    what = f"on {device}" if weights else "without weights (load_format dummy)"
    log(
        f"built {size} model ({parameter_count(size) / 1e9:.2f} B parameters) {what} "
        f"in {time.monotonic() - started:.1f}s: {target}"
    )
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--no-weights", action="store_true", help="config.json + tokenizer only (serve with load_format dummy)"
    )
    a = parser.parse_args()
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    print(ensure_model(a.size, a.seed, a.cache_dir, a.device, log=log, weights=not a.no_weights))
