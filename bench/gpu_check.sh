#!/usr/bin/env bash
# The CUDA/NCCL path in one prepared run, for a machine with NVIDIA GPUs (never CI):
# installs like `make install`, times the Triton fused-MoE kernel against its torch path at
# Qwen3-30B-A3B's expert shape (bench/gpu_moe_check.py) and the Triton LoRA kernels against
# theirs (bench/gpu_lora_check.py), then serves the W64 random Llama in
# bf16 with tp=1 (and tp=2 when two GPUs exist) on CUDA, checks the layouts agree token for
# token, prints tokens/s.
#   bash bench/gpu_check.sh    figures land in bench/results/gpu_{moe_,lora_,}check.{json,md}
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
.venv/bin/python -m bench.gpu_moe_check
.venv/bin/python -m bench.gpu_lora_check
exec .venv/bin/python -m bench.gpu_check "$@"
