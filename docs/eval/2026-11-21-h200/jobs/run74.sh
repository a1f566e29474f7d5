#!/bin/bash
# GPU run 74 (session 12, issue 4): saap-tiny v16 = v13's weights (bitwise) with the per-layer default l written
# by the recipe (top_l = 16, top_l_layers = {3: 192}), evaluated at the ARTIFACT'S DEFAULT (no eval overrides)
# on EIGHT FRESH held-out seeds never used before (848484 .. 919191; fixed before any result was seen),
# niah_single + kv_retrieval at 8192, 100 prompts per task per seed = 800 per task, pooled by scripts/pool_evals.py.
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site outputs/whl_skinny/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
mkdir -p /tmp/art && tar xJf outputs/carry74/art.tar.xz -C /tmp/art || exit 1  # run 16e2f312...'s artifact dir (xz: the 64 MiB carry limit)
A=/tmp/art/artifact
touch /tmp/stamp
ev() { name=$1; seed=$2; shift 2; s=$(date +%s)
  timeout 560 python3 -m calib eval artifact=$A "eval.tasks=[niah_single,kv_retrieval]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=$seed "$@" > /tmp/ev_${name}_$seed.out 2> /tmp/ev_${name}_$seed.err
  echo "ev $name seed=$seed rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
for seed in 848484 858585 868686 878787 888888 898989 909090 919191; do ev v16_default $seed & done
wait
date -u >> $OUT/log.txt
mkdir -p /tmp/e; i=0
for j in $(find artifacts -name eval.json -newer /tmp/stamp); do i=$((i+1)); cp $j /tmp/e/$i.json; done
tail -n 3 /tmp/ev_*.err > /tmp/e/stderr_tails.txt
cp /tmp/ev_*.out /tmp/e/ 2>/dev/null
tar czf $OUT/evals.tgz -C /tmp e
cat $OUT/log.txt; echo "eval.json files: $i"; grep -h "niah\|kv_\|select\|diff" /tmp/ev_*.out | head -60
