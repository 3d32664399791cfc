"""llama.cpp's `llama-server`, built here once per version and variant and cached (there is no wheel or distro
package of it).

The source is the vendored llama.cpp of the `llama-cpp-python` sdist (PyPI, through pip). Only the server target
is built, statically linked (one file, no .so beside it), for this machine's CPU (GGML_NATIVE) and, on a host whose
NVIDIA GPUs nvidia-smi lists and whose CUDA toolkit has nvcc, with the CUDA backend for those GPUs' architectures.
The variant (backend, GPU architectures, and the CPU's instruction-set extensions a native build uses) names the
cache directory, so a cache shared by machines of different CPUs or GPUs never hands one of them a binary built
for another (`FLAGSCALE_LLAMA_CPP_BACKEND=cpu|cuda` overrides the backend). The converter (convert_hf_to_gguf.py
and its gguf-py) is kept beside it: flagscale/demo_model.py makes the GGUF demo model with it. The build runs in a
staging directory renamed into place when complete, under a lock, so concurrent callers build once.

    python -m flagscale.engines.llama_cpp_build        # build if missing, print the binary's path
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flagscale.errors import ConfigError
from flagscale.paths import default_cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
BUILD_TIMEOUT_S = 3600  # ~10 CPU-minutes on two shared cores; a bound, not an estimate
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # the server lives under tools/
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would fetch the web UI from the network; the API needs none
    "-DLLAMA_OPENSSL=OFF",  # serves plain HTTP on the replica's address; never fetches models itself
    "-DGGML_NATIVE=ON",
]


BACKEND_ENV = "FLAGSCALE_LLAMA_CPP_BACKEND"
# x86 instruction-set extensions (/proc/cpuinfo flags) that -march=native may use; other flags (hypervisor,
# constant_tsc, ...) differ between machines whose code runs the same.
X86_ISA = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|popcnt|lzcnt|abm|movbe|adx|sha|aes|pclmul|vpclmul|gfni|vaes)")


@dataclass(frozen=True)
class Variant:
    """What a built llama-server depends on beyond its version: the backend, the GPU architectures it was
    compiled for (CUDA), and the CPU extensions of the machine that built it (GGML_NATIVE)."""

    backend: str  # "cpu" or "cuda"
    cpu: str  # hash of the CPU's instruction-set extensions
    cuda_archs: tuple[str, ...] = ()  # CMAKE_CUDA_ARCHITECTURES, e.g. ("90",)

    @property
    def name(self) -> str:
        gpu = f"cuda{'-'.join(self.cuda_archs)}" if self.backend == "cuda" else "cpu"
        return f"{gpu}-{self.cpu}"

    def cmake_flags(self) -> list[str]:
        if self.backend != "cuda":
            return list(CMAKE_FLAGS)
        return [*CMAKE_FLAGS, "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(self.cuda_archs)}"]


def cpu_key(cpuinfo: str) -> str:
    """8 hex digits naming the instruction-set extensions of /proc/cpuinfo's first processor."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":  # x86
            features = sorted(f for f in value.split() if X86_ISA.match(f))
            break
        if name.strip() == "Features":  # arm64
            features = sorted(value.split())
            break
    else:
        features = []
    return hashlib.sha256(" ".join(features).encode()).hexdigest()[:8]


def cuda_architectures(query=None) -> tuple[str, ...]:
    """The compute capabilities of the GPUs nvidia-smi lists, as CMake names them ("9.0" -> "90"); () without any."""
    try:
        out = (query or _nvidia_smi_compute_caps)()
    except (OSError, subprocess.SubprocessError):
        return ()
    caps = {line.strip().replace(".", "") for line in out.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())}
    return tuple(sorted(caps))


def _nvidia_smi_compute_caps() -> str:
    argv = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def nvcc() -> str | None:
    """The CUDA compiler: on PATH, or where the toolkit installs it."""
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


@functools.cache
def variant() -> Variant:
    """This machine's variant: CUDA where nvidia-smi lists GPUs and nvcc is there (FLAGSCALE_LLAMA_CPP_BACKEND
    overrides), else CPU."""
    try:
        cpu = cpu_key(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = cpu_key("")
    wanted = os.environ.get(BACKEND_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ConfigError(f"{wanted!r}: the llama.cpp backend is cpu or cuda", BACKEND_ENV)
    if wanted == "cpu":
        return Variant("cpu", cpu)
    archs = cuda_architectures()
    if archs and (nvcc() or wanted == "cuda"):
        return Variant("cuda", cpu, archs)
    if wanted == "cuda":
        raise ConfigError("cuda, but nvidia-smi lists no GPU here", BACKEND_ENV)
    return Variant("cpu", cpu)


def install_dir(cache_dir: Path | None = None, built_for: Variant | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"llama-cpp-{LLAMA_CPP_PYTHON_VERSION}-{(built_for or variant()).name}"


def _unkeyed_dir(cache_dir: Path | None = None) -> Path:
    """Where builds went before the variant named the directory (CPU builds, by version only)."""
    return (cache_dir or default_cache_dir()) / f"llama-cpp-{LLAMA_CPP_PYTHON_VERSION}"


def server_binary(cache_dir: Path | None = None) -> Path:
    return install_dir(cache_dir) / "bin" / "llama-server"


def converter_dir(cache_dir: Path | None = None) -> Path:
    """Where convert_hf_to_gguf.py and gguf-py/ of the same llama.cpp version are kept."""
    return install_dir(cache_dir) / "convert"


def is_built(cache_dir: Path | None = None) -> bool:
    return (install_dir(cache_dir) / ".complete").exists()


def _run(argv: list[str], cwd: Path, log) -> None:
    log(f"$ {' '.join(argv)}")
    subprocess.run(argv, cwd=cwd, check=True, timeout=BUILD_TIMEOUT_S)


def _fetch_sdist(work: Path, log) -> Path:
    """The sdist in `work`: the file FLAGSCALE_LLAMA_CPP_SDIST names (a host without a package index; pip's
    download of an sdist would also want its build backend from the index), else pip's download."""
    given = os.environ.get("FLAGSCALE_LLAMA_CPP_SDIST")
    if given:
        path = Path(given)
        if path.name != f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz" or not path.is_file():
            raise ConfigError(
                f"FLAGSCALE_LLAMA_CPP_SDIST={given}: expected the file llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
            )
        log(f"sdist: {path}")
        shutil.copy2(path, work / path.name)
    else:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
              str(work)], work, log)  # fmt: skip
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    return sdist


def _unpack(sdist: Path, into: Path) -> None:
    """Extract the sdist, refusing members that would land outside `into`. Python's own "data" filter does this
    where it exists; Debian's 3.11.2, which CI uses, predates it (3.11.4)."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(into, filter="data")
            return
        root = into.resolve()
        for member in archive.getmembers():
            target = (into / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
                raise tarfile.TarError(f"{sdist}: unsafe member {member.name!r} (only files and folders inside)")
        archive.extractall(into)


def _build(staging: Path, work: Path, jobs: int, built_for: Variant, log) -> None:
    sdist = _fetch_sdist(work, log)
    _unpack(sdist, work)
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = work / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), *built_for.cmake_flags()], work, log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], work, log)
    (staging / "bin").mkdir()
    shutil.copy2(build / "bin" / "llama-server", staging / "bin" / "llama-server")
    (staging / "convert").mkdir()
    shutil.copy2(source / "convert_hf_to_gguf.py", staging / "convert" / "convert_hf_to_gguf.py")
    if (source / "conversion").is_dir():  # newer converters import their model table from here
        shutil.copytree(source / "conversion", staging / "convert" / "conversion")
    shutil.copytree(source / "gguf-py", staging / "convert" / "gguf-py")
    (staging / ".complete").write_text(f"{SDIST} {built_for.name}\n")


def ensure_built(cache_dir: Path | None = None, jobs: int | None = None, log=print) -> Path:
    """The cached llama-server of this machine's variant, built first when missing (minutes: the caller says so).
    Returns the binary."""
    built_for = variant()
    target = install_dir(cache_dir, built_for)
    if is_built(cache_dir):
        return server_binary(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build finishes first; then this one finds it
        if is_built(cache_dir):
            return server_binary(cache_dir)
        unkeyed = _unkeyed_dir(cache_dir)
        if built_for.backend == "cpu" and (unkeyed / ".complete").exists():
            # A CPU build from before the variant keyed the cache was built on the machine that uses the cache,
            # as far as anything recorded can tell: taken as this machine's, as it was before.
            unkeyed.rename(target)
            log(f"llama-server of {unkeyed} taken as this machine's CPU build: {target}")
            return server_binary(cache_dir)
        started = time.monotonic()
        log(f"building llama-server ({SDIST}, {built_for.name}) into {target}: about 10 CPU-minutes")
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
            staging, work = Path(tmp) / "out", Path(tmp) / "work"
            staging.mkdir()
            work.mkdir()
            _build(staging, work, jobs or len(os.sched_getaffinity(0)), built_for, log)
            if target.exists():  # an incomplete leftover of an interrupted rename
                shutil.rmtree(target)
            staging.rename(target)
        log(f"built {server_binary(cache_dir)} in {time.monotonic() - started:.0f} s")
    return server_binary(cache_dir)


if __name__ == "__main__":
    try:
        print(ensure_built(log=lambda line: print(line, file=sys.stderr, flush=True)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
