"""The GPU suite (tests/gpu): placement and environment checks a multi-GPU host can show (issue 31, item 5).

Runs only where nvidia-smi lists GPUs (skipped everywhere else, CI included); the 2-GPU tests need 2. NVLink
multicast stays off in every process this suite starts: the variables are set here, before any child exists,
and in `experiment.envs` of every config.

  python3 -m pytest tests/gpu -q -p no:cacheprovider      # on a GPU machine, after ../shared/gpu/README.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

import checks  # noqa: E402  (benchmarks/gpu/checks.py)

if checks.gpu_count():  # CPU runs of the whole tree (CI) collect this folder too: leave their environment alone
    os.environ.update(checks.GPU_SAFE_ENV)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the lent machines
