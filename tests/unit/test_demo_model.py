import hashlib

import pytest

from flagscale.demo_model import ensure_demo_model


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_same_seed_gives_the_same_files(tmp_path):
    first = ensure_demo_model(seed=7, cache_dir=tmp_path / "a")
    second = ensure_demo_model(seed=7, cache_dir=tmp_path / "b")
    assert _digest(first) == _digest(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digest(first))


def test_different_seed_gives_different_weights(tmp_path):
    a = ensure_demo_model(seed=7, cache_dir=tmp_path)
    b = ensure_demo_model(seed=8, cache_dir=tmp_path)
    assert a != b
    assert _digest(a)["model.safetensors"] != _digest(b)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(b)["tokenizer.json"]


def test_demo_model_as_gguf_is_converted_once(tmp_path):
    from flagscale.demo_model import ensure_demo_model_gguf
    from flagscale.engines import llama_cpp_build

    if not (llama_cpp_build.converter_dir() / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp is not built here (make llama-cpp)")
    path = ensure_demo_model_gguf(seed=7, cache_dir=tmp_path)
    data = path.read_bytes()
    assert data[:4] == b"GGUF"
    # the demo tokenizer's pre-tokenizer, which the converter's table does not know by its hash
    assert b"tokenizer.ggml.pre" in data and b"gpt-2" in data
    assert b"<|assistant|>" in data  # the chat template went along
    mtime = path.stat().st_mtime_ns
    assert ensure_demo_model_gguf(seed=7, cache_dir=tmp_path) == path and path.stat().st_mtime_ns == mtime
