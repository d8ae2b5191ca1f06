#!/usr/bin/env bash
# The memory plan against a GPU: the kit's 1B-shape Llama (bench/make_model.py, random weights, byte
# tokens), micro-batch 2 and 8, pairs of 1024 (short) and 4096 (long, with activation checkpointing)
# tokens, bf16, one GPU. For each: train_dpo.py --plan's peak, then 3 real steps' peak_mem_gb (the
# largest torch.cuda.max_memory_allocated over the ranks) from metrics.jsonl; one JSON line each, with
# the plan's error and the run's own first-step check. The goal: within 10%. Then a --compile run
# and a --cpu-offload run of the short rows, each planned at its first step as every GPU run is: its
# first-step line, and how many graphs Dynamo captured (0 in a --compile run: its blocks ran eager).
# usage, from the repo root on a GPU machine: bash bench/plan_gpu.sh
set -euo pipefail
PY=${PY:-python}
O=runs/bench/plan-gpu
[ -d $O/llama-1b ] || $PY bench/make_model.py $O/llama-1b 1b
for shape in "short 1024" "long 4096 --activation-checkpointing"; do
  set -- $shape
  name=$1 length=$2
  shift 2
  rows=$O/rows-$length.jsonl
  # Rows all of one length, so that each step's micro-batches are as long as the plan's.
  $PY -c "
import json, sys
n = $length
with open('$rows', 'w') as f:
    for i in range(64):
        f.write(json.dumps({'prompt': 'p' * (n // 2), 'chosen': 'a' * (n - n // 2 - 1), 'rejected': 'b' * (n - n // 2 - 1)}) + '\n')
"
  for micro in 2 8; do
    flags=(--model $O/llama-1b --data $rows --precision bf16 --max-length $length --batch-size $((2 * micro))
      --micro-batch-size $micro --no-warm-start --num-samples 0 --no-eval-before --eval-every 0
      --cache-dir $O/cache "$@")
    plan=$($PY train_dpo.py "${flags[@]}" --plan --out-dir $O/plan 2>&1 | awk -v m=$micro '$1 == m && NF >= 2 {print $2}')
    rm -rf $O/run-$name-$micro
    $PY train_dpo.py "${flags[@]}" --max-steps 3 --out-dir $O/run-$name-$micro > $O/run-$name-$micro.log 2>&1
    measured=$($PY -c "
import json
rows = [json.loads(l) for l in open('$O/run-$name-$micro/metrics.jsonl') if '\"peak_mem_gb\"' in l]
print(max(r['peak_mem_gb'] for r in rows))")
    # The run's own check at its first step: that step's plan beside its measured peak.
    first=$(grep -o "memory: peak .*" $O/run-$name-$micro.log | head -1)
    echo "{\"rows\": \"$name\", \"micro\": $micro, \"plan_gb\": $plan, \"measured_gb\": $measured, \"error\": $($PY -c "print(round(($plan - $measured) / $measured, 4))"), \"first_step\": \"$first\"}"
  done
done
# The checks that must not change the run they check: --compile still compiles after its first
# step is planned, and --cpu-offload plans (no pinned fake tensors) and trains.
rows=$O/rows-1024.jsonl
for extra in --compile --cpu-offload; do
  out=$O/run$extra
  rm -rf $out
  $PY -c "
import json, sys
from torch._dynamo.utils import counters
import train_dpo
train_dpo.main(sys.argv[1:])
print(json.dumps({'flag': '$extra', 'dynamo_graphs': counters['stats']['unique_graphs']}))
" --model $O/llama-1b --data $rows --precision bf16 --max-length 1024 --batch-size 16 \
    --micro-batch-size 8 --no-warm-start --num-samples 0 --no-eval-before --eval-every 0 \
    --cache-dir $O/cache --max-steps 3 --out-dir $out $extra > $out.log 2>&1 || { tail -5 $out.log; continue; }
  echo "$(tail -1 $out.log | tr -d '}'), \"first_step\": \"$(grep -o "memory: peak .*\|warning: memory check .*" $out.log | head -1)\"}"
done
