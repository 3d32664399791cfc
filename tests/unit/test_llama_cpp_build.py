"""Which llama-server build a machine gets, and where it is cached (pure logic: nvidia-smi and /proc are faked)."""

from __future__ import annotations

import pytest

from flagscale.engines import llama_cpp_build as build
from flagscale.engines.llama_cpp_build import Variant
from flagscale.errors import ConfigError

X86 = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 hypervisor constant_tsc\n"


def test_the_cpu_key_follows_the_instruction_set_not_the_rest_of_the_flags():
    same_isa = X86.replace("hypervisor constant_tsc", "rdtscp")
    assert build.cpu_key(X86) == build.cpu_key(same_isa)
    assert build.cpu_key(X86) != build.cpu_key(X86.replace("avx2", "avx2 avx512f avx512bw"))
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n"
    assert build.cpu_key(arm) != build.cpu_key(arm.replace(" sve", ""))


def test_cuda_architectures_as_cmake_names_them():
    assert build.cuda_architectures(lambda: "9.0\n9.0\n8.0\n") == ("80", "90")
    assert build.cuda_architectures(lambda: "No devices were found\n") == ()

    def no_driver():
        raise FileNotFoundError("nvidia-smi")

    assert build.cuda_architectures(no_driver) == ()


def test_the_variant_names_the_cache_and_the_build_flags():
    cpu, cuda = Variant("cpu", "1f01be5b"), Variant("cuda", "1f01be5b", ("90",))
    assert cpu.name == "cpu-1f01be5b" and cuda.name == "cuda90-1f01be5b"
    assert "-DGGML_CUDA=ON" not in cpu.cmake_flags() and "-DGGML_NATIVE=ON" in cpu.cmake_flags()
    assert {"-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"} <= set(cuda.cmake_flags())
    assert (
        build.install_dir(build.Path("/c"), cuda).name == f"llama-cpp-{build.LLAMA_CPP_PYTHON_VERSION}-cuda90-1f01be5b"
    )


@pytest.fixture
def machine(monkeypatch):
    """A machine whose GPUs and nvcc the test sets: returns a setter."""
    build.variant.cache_clear()
    monkeypatch.delenv(build.BACKEND_ENV, raising=False)

    def set_machine(archs: tuple[str, ...], nvcc: str | None):
        monkeypatch.setattr(build, "cuda_architectures", lambda query=None: archs)
        monkeypatch.setattr(build, "nvcc", lambda: nvcc)

    yield set_machine
    build.variant.cache_clear()


def test_cuda_where_there_are_gpus_and_nvcc_else_cpu(machine, monkeypatch):
    machine(("90",), "/usr/local/cuda/bin/nvcc")
    assert build.variant().backend == "cuda" and build.variant().cuda_archs == ("90",)
    build.variant.cache_clear()
    machine(("90",), None)  # GPUs but no toolkit: the CPU build, as before
    assert build.variant().backend == "cpu"
    build.variant.cache_clear()
    machine((), "/usr/local/cuda/bin/nvcc")
    assert build.variant().backend == "cpu"
    build.variant.cache_clear()
    machine(("90",), "/usr/local/cuda/bin/nvcc")
    monkeypatch.setenv(build.BACKEND_ENV, "cpu")
    assert build.variant().backend == "cpu"
    build.variant.cache_clear()
    machine((), None)
    monkeypatch.setenv(build.BACKEND_ENV, "cuda")
    with pytest.raises(ConfigError, match="lists no GPU"):
        build.variant()
    build.variant.cache_clear()
    monkeypatch.setenv(build.BACKEND_ENV, "rocm")
    with pytest.raises(ConfigError, match="cpu or cuda") as info:
        build.variant()
    assert info.value.where == build.BACKEND_ENV


def test_a_cpu_build_cached_before_the_variant_keyed_it_is_taken_not_rebuilt(machine, tmp_path, monkeypatch):
    machine((), None)
    old = tmp_path / f"llama-cpp-{build.LLAMA_CPP_PYTHON_VERSION}"
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "llama-server").write_text("binary")
    (old / ".complete").write_text(build.SDIST + "\n")
    monkeypatch.setattr(build, "_build", lambda *a, **k: pytest.fail("built again"))
    binary = build.ensure_built(tmp_path, log=lambda line: None)
    assert binary == build.server_binary(tmp_path) and binary.read_text() == "binary"
    assert binary.parent.parent.name.endswith(build.variant().name) and not old.exists()


def test_a_cuda_machine_does_not_take_the_old_cpu_build(machine, tmp_path, monkeypatch):
    machine(("90",), "/usr/local/cuda/bin/nvcc")
    old = tmp_path / f"llama-cpp-{build.LLAMA_CPP_PYTHON_VERSION}"
    old.mkdir()
    (old / ".complete").write_text(build.SDIST + "\n")
    flags = []

    def fake_build(staging, work, jobs, built_for, log):
        flags.extend(built_for.cmake_flags())
        (staging / "bin").mkdir()
        (staging / "bin" / "llama-server").write_text("cuda binary")
        (staging / ".complete").write_text("done\n")

    monkeypatch.setattr(build, "_build", fake_build)
    assert build.ensure_built(tmp_path, log=lambda line: None).read_text() == "cuda binary"
    assert "-DGGML_CUDA=ON" in flags and old.exists()


def _tarball(path, members: dict[str, bytes], link: tuple[str, str] | None = None):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            archive.addfile(info)
    return path


@pytest.mark.parametrize("data_filter", [True, False], ids=["python-with-data-filter", "debian-3.11.2"])
def test_the_sdist_unpacks_inside_its_folder_with_or_without_pythons_data_filter(tmp_path, monkeypatch, data_filter):
    import tarfile

    if not data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    good = _tarball(tmp_path / "good.tar.gz", {"pkg/vendor/llama.cpp/CMakeLists.txt": b"x"})
    (tmp_path / "out").mkdir()
    build._unpack(good, tmp_path / "out")
    assert (tmp_path / "out/pkg/vendor/llama.cpp/CMakeLists.txt").read_bytes() == b"x"
    bad = _tarball(tmp_path / "bad.tar.gz", {"../escaped": b"x"})
    (tmp_path / "bad").mkdir()
    with pytest.raises(tarfile.TarError):
        build._unpack(bad, tmp_path / "bad")
    assert not (tmp_path / "escaped").exists()
    linked = _tarball(tmp_path / "link.tar.gz", {"pkg/a": b"x"}, link=("pkg/etc", "/etc"))
    (tmp_path / "link").mkdir()
    with pytest.raises(tarfile.TarError):
        build._unpack(linked, tmp_path / "link")


def test_a_given_sdist_is_used_instead_of_the_index_and_a_wrong_one_is_named(tmp_path, monkeypatch):
    sdist = tmp_path / f"llama_cpp_python-{build.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    sdist.write_bytes(b"sdist")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("FLAGSCALE_LLAMA_CPP_SDIST", str(sdist))
    assert build._fetch_sdist(work, log=lambda _line: None).read_bytes() == b"sdist"
    monkeypatch.setenv("FLAGSCALE_LLAMA_CPP_SDIST", str(tmp_path / "llama_cpp_python-0.0.1.tar.gz"))
    with pytest.raises(ConfigError, match="FLAGSCALE_LLAMA_CPP_SDIST=.*0.0.1"):
        build._fetch_sdist(tmp_path, log=lambda _line: None)
