"""llama.cpp's `llama-server`, built here once per version and cached (there is no wheel or distro package of it).

The source is the vendored llama.cpp of the `llama-cpp-python` sdist (PyPI, through pip). Only the server target
is built, statically linked (one file, no .so beside it), for this machine's CPU (GGML_NATIVE). The converter
(convert_hf_to_gguf.py and its gguf-py) is kept beside it: flagscale/demo_model.py makes the GGUF demo model with
it. The build runs in a staging directory renamed into place when complete, under a lock, so concurrent callers
build once.

    python -m flagscale.engines.llama_cpp_build        # build if missing, print the binary's path
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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


def install_dir(cache_dir: Path | None = None) -> Path:
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


def _build(staging: Path, work: Path, jobs: int, log) -> None:
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(work)],
         work, log)  # fmt: skip
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = work / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], work, log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], work, log)
    (staging / "bin").mkdir()
    shutil.copy2(build / "bin" / "llama-server", staging / "bin" / "llama-server")
    (staging / "convert").mkdir()
    shutil.copy2(source / "convert_hf_to_gguf.py", staging / "convert" / "convert_hf_to_gguf.py")
    if (source / "conversion").is_dir():  # newer converters import their model table from here
        shutil.copytree(source / "conversion", staging / "convert" / "conversion")
    shutil.copytree(source / "gguf-py", staging / "convert" / "gguf-py")
    (staging / ".complete").write_text(SDIST + "\n")


def ensure_built(cache_dir: Path | None = None, jobs: int | None = None, log=print) -> Path:
    """The cached llama-server, built first when missing (minutes: the caller says so). Returns the binary."""
    target = install_dir(cache_dir)
    if is_built(cache_dir):
        return server_binary(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build finishes first; then this one finds it
        if is_built(cache_dir):
            return server_binary(cache_dir)
        started = time.monotonic()
        log(f"building llama-server ({SDIST}) into {target}: about 10 CPU-minutes")
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
            staging, work = Path(tmp) / "out", Path(tmp) / "work"
            staging.mkdir()
            work.mkdir()
            _build(staging, work, jobs or os.cpu_count() or 1, log)
            if target.exists():  # an incomplete leftover of an interrupted rename
                shutil.rmtree(target)
            staging.rename(target)
        log(f"built {server_binary(cache_dir)} in {time.monotonic() - started:.0f} s")
    return server_binary(cache_dir)


if __name__ == "__main__":
    print(ensure_built(log=lambda line: print(line, file=sys.stderr, flush=True)))
