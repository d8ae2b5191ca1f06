#!/usr/bin/env bash
# The demo, on-policy against offline at the same number of optimizer steps, from the repo root: from the
# demo's SFT stage, 3 on-policy rounds (bench/onpolicy.sh: 512 prompts a round, K = 4 samples scored by the
# demo's ground truth) against DPO on the demo's written pairs for as many steps as the rounds took, with the
# same settings for both (the demo's DPO settings, at LR: 1e-4; at its 3e-5 neither moves far in ~40 steps).
# Each model, and the SFT stage, is then judged alike: 4 samples at temperature
# 1 for each of the 256 held-out prompts (products never seen in training), the share the ground truth
# scores in the preferred style.
#   bash bench/onpolicy_demo.sh && cat runs/bench/onpolicy-demo/preferred.txt
set -eu
PY=${PY:-python} O=runs/bench/onpolicy-demo
FLAGS="--lr ${LR:-1e-4} --beta 0.5 --batch-size 32 --num-samples 0 --no-eval-before"
OUT=$O/rounds ROUNDS=3 PROMPTS=512 K=4 REWARD=demo TRAIN_FLAGS="$FLAGS" PY=$PY bash bench/onpolicy.sh
steps=$($PY -c "import json; print(sum(sum(json.loads(l).get('split') == 'train' for l in open(f'$O/rounds/round-{r}/metrics.jsonl')) for r in (1, 2, 3)))")
if [ ! -d $O/offline/final ]; then
  $PY train_dpo.py --model runs/cache/demo-sft/final --data runs/cache/demo-train.jsonl \
    --max-steps "$steps" --out-dir $O/offline $FLAGS
fi
echo "on-policy rounds and offline: $steps optimizer steps each" > $O/preferred.txt
for model in runs/cache/demo-sft/final $O/offline/final $O/rounds/round-3/final; do
  $PY generate.py --model $model --data runs/cache/demo-eval.jsonl --num-generations 4 --reward demo \
    --out $O/judged/$(echo $model | tr / _).jsonl > /dev/null
  $PY -c "import json; s = [x for l in open('$O/judged/$(echo $model | tr / _).jsonl') for x in json.loads(l)['scores']]; print('$model:', f'{s.count(1.0) / len(s):.3f} preferred of', len(s), 'samples')" >> $O/preferred.txt
done
cat $O/preferred.txt
