#!/usr/bin/env bash
# What each objective option costs per step: steady pairs/s (bench/steady.py) of 20 steps on the 60M model, fp32,
# batch 8, the same data and flags as bench/rounds.sh, with no option and with each, interleaved over ROUNDS
# rounds (default 2). From the repo root, after bench/rounds.sh's first two setup lines:
#   bash bench/objective_cost.sh && cat runs/bench/objective_cost.txt
set -eu
PY=${PY:-python} M=runs/bench/llama-60m D=runs/bench/demo.jsonl O=runs/bench/cost T=runs/bench/objective_cost.txt
mkdir -p $O
for round in $(seq ${ROUNDS:-2}); do
  for option in none "--use-weighting" "--ld-alpha 0.5" "--sync-ref-model --ref-model-sync-steps 1"; do
    flags=$option; [ "$option" = none ] && flags=
    name=$(echo "$option" | tr -d ' -' | cut -c1-24)
    $PY train_dpo.py --model $M --data $D --max-steps 20 --batch-size 8 --lr 1e-5 --out-dir $O/$name-$round \
        --cache-dir $O/cache --no-eval-before --num-samples 0 $flags > $O/$name-$round.log 2>&1
    echo "$option round $round $($PY bench/steady.py $O/$name-$round/metrics.jsonl 8)" >> $T
  done
done
