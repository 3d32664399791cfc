import hashlib

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
