#!/usr/bin/env bash
# GPU check: a few self-guided GRPO steps with a random-init 0.39 B Qwen2-shaped model (nothing to download), printing
# rollout tokens/s, update tokens/s, peak GPU memory and the sampler/trainer log-prob gap.  Needs only the repo and the
# packages a PyTorch image carries plus this package's dependencies.
#   bash benchmarks/gpu_check.sh                       # 1 GPU (DDP-free)
#   STRATEGY=fsdp1 DEVICES=2 bash benchmarks/gpu_check.sh   # FSDP1 (FSDPStrategy) on 2 GPUs
#   STRATEGY=fsdp2 DEVICES=2 bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e . 2>/dev/null || python -m pip install -q --no-deps -e .
export TOKENIZERS_PARALLELISM=false
python benchmarks/gpu_check.py --strategy "${STRATEGY:-auto}" --devices "${DEVICES:-1}" --steps "${STEPS:-3}" "$@"
