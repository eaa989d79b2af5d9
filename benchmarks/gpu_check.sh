#!/usr/bin/env bash
# GPU check: a few self-guided GRPO steps through `sglightning fit` (seeded, validated before and after) with a
# random-init model of a real shape (nothing to download), printing rollout tokens/s against the decode roofline,
# update tokens/s and MFU, peak GPU memory and the sampler/trainer log-prob gap.
#   bash benchmarks/gpu_check.sh                                   # the 0.39 B probe, 8 x 8 episodes, 1 GPU
#   bash benchmarks/gpu_check.sh --shape qwen3-1.7b --groups 16    # the paper's 16 x 8 episodes
#   STRATEGY=fsdp2 DEVICES=2 bash benchmarks/gpu_check.sh          # FSDP2 on 2 GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import sglightning" 2>/dev/null || python -m pip install -q -e . 2>/dev/null || python -m pip install -q --no-deps -e .
export TOKENIZERS_PARALLELISM=false
python benchmarks/gpu_check.py --strategy "${STRATEGY:-auto}" --devices "${DEVICES:-1}" --steps "${STEPS:-3}" "$@"
