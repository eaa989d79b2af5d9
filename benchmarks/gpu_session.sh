#!/usr/bin/env bash
# The GPU checks of one lent GPU machine (an H100 or H200: a session has 15 minutes of device time, start and idle
# included), every stage under its own timeout, its output appended to $OUT/log.txt, gpu_check's numbers to
# $OUT/results.jsonl, a table printed last (and kept in $OUT/table.md).  A check cut by its timeout still reports the
# steps it finished (gpu_check's .steps.jsonl, marked "cut at step N").  Prepare the bundle first, on a machine with
# network:
#   bash benchmarks/gpu_bundle.sh             # .gpu/: jsonargparse + gguf wheels, the SmolLM2 GGUF in two halves
# and run the suite under the GPU machine's package versions on this CPU: bash .ci/versions device
# then, through the device tool, on one warm machine, the issues' floors first:
#   part 1 (carry .gpu/wheels .gpu/gguf1 .gpu/env.sh .gpu/stash.sh; <= 7 min, so a fix and a rerun fit): bash benchmarks/gpu_session.sh 1
#       CUDA tests (every decode step, the engine's own graphs included, vs the dynamic cache; the tiny config's fit, resume and validate), the 0.39 B
#       probe at 8 x 8 episodes (floor: 11 k rollout tok/s), the Qwen3-1.7B shape at the paper's 16 x 8 (floors: 3 k
#       rollout tok/s, 25 % update MFU); each profiles its last step (where the time goes, how busy the GPU is:
#       $OUT/<run>.profile.md; that step is left out of the throughput)
#   part 2 (carry .gpu/wheels .gpu/gguf2 .gpu/env.sh; <= 5 min): bash benchmarks/gpu_session.sh 2
#       the quickstart (embedded SmolLM2, bf16; floor: rollout <= 1.5 s/step), the Qwen3-4B shape at 16 x 8
#   parts 3-10 need no model (carry .gpu/wheels): each fits a session of its own, or the time parts 1-2 leave
#   part 3 (<= 8 min): the probe compiled by inductor without CUDA graphs (what the graphs add), without
#       rollout correction (the ratio spread it corrects), under FSDP2 on one GPU (its step time
#       against part 1's probe)
#   part 4, the same (<= 8 min): the engine's host time per lock step on this machine's CPU (the ceiling the host puts
#       on rollout tokens/s), the probe with the dynamic cache (what the static cache adds), the Qwen3-1.7B update
#       with micro-batches by token budget instead of shared prefixes (its MFU against part 1)
#   part 5, the same (<= 6 min): the Qwen3-1.7B shape at 16 x 8 in the paper's two_call mode, each call's cache kept
#       across env steps (two caches, a graph per cache) and not kept (rollout.reuse_prefix: false)
#   part 6, the same (<= 6 min): the Qwen3-1.7B shape at 16 x 8 with its last few rows of a turn running alone
#       (the default) and with every row to the end of each turn (model.engine.few_rows_alone: false)
#   part 7, the same (<= 5 min): the probe in two_call with room for both calls' caches (the default limit) and with
#       a limit so low that one cache serves both calls (model.engine.cache_memory: 0.001; caches handed over on
#       CUDA, graphs kept: compare compiles and rollout s/step)
#   part 8, the same (<= 8 min): part 4's Qwen3-1.7B update by token budget with its decoder layers compiled
#       (model.update.compile: true; compare update tok/s and MFU with part 4's row), then part 1's shared prefixes
#       with compiled layers (compare with part 1's Qwen3-1.7B row)
#   part 9, the same (<= 9 min): the shapes part 1 leaves out: Qwen2.5-0.5B's grouped-query layout at 8 x 8 and at
#       16 x 8, and the Qwen3-1.7B and Qwen3-4B shapes at 64 episodes (8 x 8)
#   part 10, the same (<= 9 min): torch's Python per decode step at 28 layers (step_guards.py: guards
#       checked at every call, once per signature, the engine's own CUDA graphs), then the probe with torch's CUDA
#       graphs (reduce-overhead, the default) and with the engine's (model.engine.compile: graphs), one after the
#       other; then the Qwen3-1.7B shape at 16 x 8 with the engine's (compare with part 1's row)
# Without the bundle, `PY=python bash benchmarks/gpu_session.sh 1` runs where sglightning is installed.
# `CPU_SMOKE=1` runs the same stages on a CPU with tiny shapes (and the tiny config for the quickstart): a check of the
# script itself, its stages, partial results and table, before device time is spent on it (tests/test_gpu_check.py).
set -uo pipefail
part=${1:-1}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sgl-gpu-session}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -f .gpu/env.sh ]; then
  [ -f .gpu/stash.sh ] && [ -d .gpu/gguf1 ] && bash .gpu/stash.sh
  # shellcheck disable=SC1091
  source .gpu/env.sh
else
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  if [ -d .gpu/wheels ] && ! "$PY" -c "import jsonargparse" 2>/dev/null; then  # the wheels carried without env.sh
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
fi
export SGLIGHTNING_CACHE=${SGLIGHTNING_CACHE:-/tmp/sglcache}

stage() {  # stage NAME SECONDS COMMAND...: run under a timeout, log it, note its exit status and time
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== $name ($(date -u +%FT%TZ), limit ${limit}s): $*" >> "$OUT/log.txt"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >> "$OUT/log.txt" 2>&1
  rc=$?
  echo "| $name | $rc | $(( $(date +%s) - t0 )) s |" >> "$OUT/stages.md"
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
}

check() {  # check NAME SECONDS ARGS...: benchmarks/gpu_check.py, its numbers appended to results.jsonl
  local name=$1 limit=$2
  shift 2
  [ "${CPU_SMOKE:-0}" != 0 ] && set -- "$@" --cpu-smoke
  rm -f "$OUT/$name.json" "$OUT/$name.json.steps.jsonl"  # an earlier session's files must not pass for this one's
  stage "$name" "$limit" "$PY" benchmarks/gpu_check.py --json "$OUT/$name.json" "$@"
  [ -f "$OUT/$name.json" ] || [ ! -f "$OUT/$name.json.steps.jsonl" ] || \
    "$PY" benchmarks/gpu_check.py --from-steps "$OUT/$name.json.steps.jsonl" --json "$OUT/$name.json" >> "$OUT/log.txt" 2>&1
  [ -f "$OUT/$name.json" ] && "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d['run']=sys.argv[2]; \
print(json.dumps(d))" "$OUT/$name.json" "$name" >> "$OUT/results.jsonl" && rm -f "$OUT/$name.json"
}

echo "| stage | exit | time |" > "$OUT/stages.md"
echo "|---|---|---|" >> "$OUT/stages.md"
{ nvidia-smi -L; "$PY" -c "import torch, transformers, lightning; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'lightning', lightning.__version__)"; git log -1 --format='%h %s'; } \
  >> "$OUT/log.txt" 2>&1

if [ "$part" = 1 ]; then
  # no -x: every failure is news; -v: a stage cut by its timeout still shows which test it was in
  stage cuda_tests 140 "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_gpu.py
  check probe_8x8 100 --shape probe --groups 8 --group-size 8 --val-tasks 4 --steps 4 \
    --profile "$OUT/probe_8x8.profile.md"
  check qwen3-1.7b_16x8 140 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --profile "$OUT/qwen3-1.7b_16x8.profile.md"
elif [ "$part" = 2 ]; then
  if [ "${CPU_SMOKE:-0}" != 0 ]; then quick=(--config configs/tiny.yaml --trainer.max_steps=2)
  else quick=(--config configs/quickstart.yaml --trainer.accelerator=gpu --trainer.precision=bf16-mixed \
    --model.policy.dtype=bfloat16); fi
  stage quickstart 170 "$PY" -m sglightning fit "${quick[@]}" "--trainer.default_root_dir=$OUT/runs" \
    "--trainer.logger.init_args.save_dir=$OUT/runs"
  check qwen3-4b_16x8 120 --shape qwen3-4b --groups 16 --group-size 8 --val-tasks 4
elif [ "$part" = 9 ]; then
  check qwen2.5-0.5b_8x8 120 --shape qwen2.5-0.5b --groups 8 --group-size 8 --val-tasks 4
  check qwen2.5-0.5b_16x8 120 --shape qwen2.5-0.5b --groups 16 --group-size 8 --val-tasks 4
  check qwen3-1.7b_8x8 130 --shape qwen3-1.7b --groups 8 --group-size 8 --val-tasks 4
  check qwen3-4b_8x8 150 --shape qwen3-4b --groups 8 --group-size 8 --val-tasks 4
elif [ "$part" = 10 ]; then
  if [ "${CPU_SMOKE:-0}" != 0 ]; then guards=(--layers 2 --calls 10 --repeats 1)
  else guards=(--device cuda --mode reduce-overhead --graphs --layers 28 --repeats 3); fi
  rm -f "$OUT/step_guards.json"  # an earlier session's numbers must not pass for this one's
  stage step_guards 150 "$PY" benchmarks/step_guards.py "${guards[@]}" --json "$OUT/step_guards.json"
  check probe_8x8 100 --shape probe --groups 8 --group-size 8 --val-tasks 4 --steps 4
  check probe_8x8_graphs 100 --shape probe --groups 8 --group-size 8 --val-tasks 4 --steps 4 --compile graphs
  check qwen3-1.7b_16x8_graphs 140 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 --compile graphs
elif [ "$part" = 3 ]; then
  check probe_8x8_inductor 150 --shape probe --groups 8 --group-size 8 --val-tasks 4 --compile default
  check probe_8x8_no_correction 150 --shape probe --groups 8 --group-size 8 --val-tasks 4 \
    --set model.grpo.rollout_correction=null
  check probe_8x8_fsdp2 170 --shape probe --groups 8 --group-size 8 --val-tasks 4 --strategy fsdp2 --devices 1
elif [ "$part" = 5 ]; then
  check qwen3-1.7b_16x8_two_call 170 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.guidance.prompt_mode=two_call
  check qwen3-1.7b_16x8_two_call_fresh 170 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.guidance.prompt_mode=two_call --set model.rollout.reuse_prefix=false
elif [ "$part" = 6 ]; then
  check qwen3-1.7b_16x8 200 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4
  check qwen3-1.7b_16x8_all_rows 200 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.engine.few_rows_alone=false
elif [ "$part" = 7 ]; then
  check probe_8x8_two_call 150 --shape probe --groups 8 --group-size 8 --val-tasks 4 \
    --set model.guidance.prompt_mode=two_call
  check probe_8x8_two_call_one_cache 150 --shape probe --groups 8 --group-size 8 --val-tasks 4 \
    --set model.guidance.prompt_mode=two_call --set model.engine.cache_memory=0.001
elif [ "$part" = 8 ]; then
  check qwen3-1.7b_16x8_token_budget_compiled 220 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.update.share_prefix=false --set model.update.micro_batch_size=16 \
    --set model.update.micro_batch_tokens=32768 --set model.update.compile=true
  check qwen3-1.7b_16x8_shared_compiled 220 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.update.compile=true
else
  stage engine_host 90 "$PY" benchmarks/engine_host.py --repeats 3 --json "$OUT/engine_host.json"
  check probe_8x8_dynamic 150 --shape probe --groups 8 --group-size 8 --val-tasks 4 --compile off
  check qwen3-1.7b_16x8_token_budget 200 --shape qwen3-1.7b --groups 16 --group-size 8 --val-tasks 4 \
    --set model.update.share_prefix=false --set model.update.micro_batch_size=16 \
    --set model.update.micro_batch_tokens=32768
fi
rm -rf "$OUT/runs"

{
  echo
  echo "| run | shape | episodes | decode step | rollout tok/s (share of roofline) | rollout s/step | update tok/s (MFU) | peak GB (slot caches) | validation before -> after | sampler ratio outside [0.9, 1.1] / max | compiles / graph skips / graph pieces / decode calls guarded of all | GPU busy: rollout / update | rollout s: prefill / decode / draw |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  [ -f "$OUT/results.jsonl" ] && "$PY" - "$OUT/results.jsonl" <<'PY'
import json, sys
def busy(o, name):
    prof = o.get("profile") or {}
    p = prof.get("phases", {}).get(name)
    if not prof.get("device_events"):  # no kernel recorded (no profile, or no CUPTI): unknown, not idle
        return "-"
    return f"{100 * p['device_s'] / p['wall_s']:.0f} %" if p and p["wall_s"] > 0 else "-"
def guarded(o):
    c = o.get("decode_calls") or {}
    n = c.get("checked", 0) + c.get("skipped", 0)
    return f"{c['checked']} of {n}" + (f", {c['replayed']} replayed" if c.get("replayed") else "") if n else "-"
for line in open(sys.argv[1]):
    o = json.loads(line)
    share = f" ({100 * o['roofline_share']:.1f} % of {o['decode_roofline_tokens_per_s']:,.0f})" if o.get("roofline_share") else ""
    mfu = f" ({100 * o['update_mfu']:.1f} %)" if o.get("update_mfu") else ""
    cut = f" (cut at step {o['steps']})" if o.get("partial") else ""
    print(f"| {o['run']}{cut} | {o['shape']} | {o['episodes_per_step']:.0f} | {o.get('decode_step')} | "
          f"{o['rollout_tokens_per_s']:,.0f}{share} | {o['rollout_s_per_step']:.2f} | {o['update_tokens_per_s']:,.0f}{mfu} | "
          f"{o.get('peak_memory_GB') or 0:.1f} ({o.get('slot_cache_GB') or 0:.1f}) | {o['validation_before']} -> {o['validation_after']} | "
          f"{o.get('sampler_ratio_outside_0.9_1.1', float('nan')):.4f} / {o.get('sampler_ratio_max', float('nan')):.3f} | "
          f"{o.get('compiles')} / {o.get('cudagraph_skips')} / {o.get('cudagraph_partitions')} / {guarded(o)} | {busy(o, 'rollout')} / {busy(o, 'update')} | "
          + " / ".join(f"{o.get('phase_s', {}).get('rollout_' + p, float('nan')):.2f}" for p in ("prefill", "decode", "draw"))
          + " |")
PY
  [ -f "$OUT/step_guards.json" ] && "$PY" - "$OUT/step_guards.json" <<'PY'
import json, sys
print("\n| decode step, µs per call [outside compiled code] | guards checked every call | once per signature | "
      "the engine's CUDA graphs | traces |")
print("|---|---|---|---|---|")
for r in json.load(open(sys.argv[1]))["rows"]:
    cell = lambda a: (f"{r[a]['us']:.0f} [" + (f"{r[a]['outside_us']:.0f}" if r[a]["outside_us"] is not None
                      else "-") + "]") if a in r else "-"
    print(f"| {r['layers']} layers | {cell('checked')} | {cell('once')} | {cell('graphs')} | {r['traces']} |")
PY
  echo
  cat "$OUT/stages.md"
} > "$OUT/table.md"
grep -h "validation\|time per step\|success rate" "$OUT/log.txt" | tail -8
cat "$OUT/table.md"
