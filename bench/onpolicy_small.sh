#!/usr/bin/env bash
# The README's small on-policy command, measured, from the repo root: one round from the demo's SFT stage (which
# `python train_dpo.py` writes on its first run) on 512 of the demo's prompts, K = 4 samples each scored by the
# demo's ground truth, then DPO on those rows; the SFT stage and the result judged alike by generate.py on the
# 256 held-out prompts (4 samples each at temperature 1: "mean_score" in its sidecar, +1 praise, -1 criticism).
#   bash bench/onpolicy_small.sh && cat runs/bench/onpolicy-small/judged.txt
set -eu
PY=${PY:-python} O=runs/bench/onpolicy-small
if [ ! -d runs/cache/demo-sft/final ]; then $PY train_dpo.py; fi
$PY generate.py --max-prompts 512 --out $O/rows.jsonl
$PY train_dpo.py --model runs/cache/demo-sft/final --data $O/rows.jsonl \
    --eval-data runs/cache/demo-eval.jsonl --lr 1e-4 --beta 0.5 --out-dir $O/dpo
: > $O/judged.txt
for model in runs/cache/demo-sft/final $O/dpo/final; do
  $PY generate.py --model $model --data runs/cache/demo-eval.jsonl --out $O/judged-$(basename $(dirname $model)).jsonl
  $PY -c "import json, sys; s = [x for l in open(sys.argv[2]) for x in json.loads(l)['scores']]; print(sys.argv[1], f'preferred {s.count(1.0) / len(s):.3f}, rejected style {s.count(-1.0) / len(s):.3f} of {len(s)} samples')" \
    $model $O/judged-$(basename $(dirname $model)).jsonl >> $O/judged.txt
done
