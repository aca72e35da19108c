# Two commands for a fresh machine with only Python and pip (see README.md):
#   make demo   # creates .venv, installs aligner, runs SFT -> RM -> PPO on the built-in task
#   make test   # creates .venv, installs aligner[test], runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.aligner-installed

.PHONY: install demo test test-fast clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf outputs .pytest_cache
