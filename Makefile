# `make serve`: set up what is missing, then serve the embedded demo model (`flagscale serve demo`).
# `make test`:  set up what is missing, then run the whole test suite.
# `make llama-cpp`: build llama.cpp's llama-server (engine: llama_cpp) once per version into the cache.
VENV    ?= .venv
PYTHON  ?= python3
FLAVOR  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
PY      := $(VENV)/bin/python
LOCK    := $(wildcard requirements/$(FLAVOR).lock)
# Named by the requirements' content, not their dates: a venv that outlives the checkout (CI's, .ci/run) is
# reinstalled only when the pins change, not each time a fresh clone gives the files new dates.
REQS    := requirements/base.txt requirements/$(FLAVOR).txt requirements/nixl.txt $(LOCK)
STAMP   := $(VENV)/.installed-$(FLAVOR)-$(shell cat $(REQS) | sha256sum | cut -c1-12)
PROJECT := $(VENV)/.installed-project
FLAGSCALE := $(VENV)/bin/flagscale

.PHONY: setup sshd llama-cpp serve status stop test unit test-gpu lint format bench clean-venv

setup: $(STAMP) $(PROJECT)

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/$(FLAVOR).txt $(if $(LOCK),-c $(LOCK))
	# NIXL (KV transfer of prefill/decode disaggregation): its declared deps would pull a CUDA torch.
	$(PY) -m pip install -q --no-deps -r requirements/nixl.txt
	# PyPI's torchvision/torchaudio/torchcodec come with vLLM but break beside the CPU torch build.
	$(if $(filter cpu,$(FLAVOR)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(PY) -c "import vllm, ray.serve, hydra, paramiko, nixl"
	touch $@

# The project itself (the `flagscale` command), editable, after the pinned requirements: --no-deps, so that pip does
# not resolve vLLM again (an unconstrained resolve can swap the CPU torch for a multi-GB CUDA one).
$(PROJECT): pyproject.toml $(STAMP)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

serve: setup
	$(FLAGSCALE) serve demo

status: setup
	$(FLAGSCALE) serve demo --status

stop: setup
	$(FLAGSCALE) serve demo --stop

test: setup sshd lint llama-cpp
	$(PY) -m pytest tests

# One style for the whole tree (settings in pyproject.toml); `make format` applies it.
lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The multi-host tests run an sshd per test host (tests/e2e/netns.py); install it only when missing.
sshd:
	test -x /usr/sbin/sshd || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server)

# No wheel or distro package has it: built from the llama-cpp-python sdist's vendored llama.cpp (only the server,
# ~10 CPU-minutes the first time; flagscale/engines/llama_cpp_build.py), a no-op once cached.
llama-cpp: setup
	command -v cmake >/dev/null && command -v g++ >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++)
	$(PY) -m flagscale.engines.llama_cpp_build

unit: setup
	$(PY) -m pytest tests/unit

# On a GPU machine after ../shared/gpu/README.md's install (python3 with /tmp/site): placement and env checks (issue 31)
test-gpu:
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 $(PYTHON) -m pytest tests/gpu -v -p no:cacheprovider

bench: setup
	$(PY) benchmarks/overhead.py

clean-venv:
	rm -rf $(VENV)
