#!/usr/bin/env bash
# GPU check: a few self-guided GRPO steps through `sglightning fit` (seeded, validated before and after) with a
# random-init model of a real shape (nothing to download), printing rollout tokens/s against the decode roofline,
# update tokens/s and MFU, peak GPU memory and the sampler/trainer log-prob gap.
#   bash benchmarks/gpu_check.sh                                   # the 0.39 B probe, 8 x 8 episodes, 1 GPU
#   bash benchmarks/gpu_check.sh --shape qwen3-1.7b --groups 16    # the paper's 16 x 8 episodes
#   STRATEGY=fsdp2 DEVICES=2 bash benchmarks/gpu_check.sh          # FSDP2 on 2 GPUs
# On the lent machine (offline, no pip install): carry .gpu/wheels and .gpu/env.sh (benchmarks/gpu_bundle.sh) and it
# is sourced here; elsewhere the checkout's src/ is put on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/env.sh ]; then
  source .gpu/env.sh
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
python3 -c "import sglightning, jsonargparse" || { echo "gpu_check.sh: install the package (pip install -e .) or carry .gpu/ (benchmarks/gpu_bundle.sh)" >&2; exit 2; }
python3 benchmarks/gpu_check.py --strategy "${STRATEGY:-auto}" --devices "${DEVICES:-1}" --steps "${STEPS:-3}" "$@"
