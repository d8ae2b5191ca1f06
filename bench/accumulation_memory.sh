#!/usr/bin/env bash
# Gradient accumulation, reduce-scattered after every micro-batch (the default) or accumulated unsharded
# (--unsharded-grad-accumulation): peak host memory per rank and step time, 2 gloo ranks on CPU, the 270M model,
# batch 8 = 4 micro-batches of 1 pair per rank, 3 steps,
# a 4-pair evaluation. From the repo root: bash bench/accumulation_memory.sh
set -euo pipefail
mkdir -p runs/bench
[ -f runs/bench/llama-270m/config.json ] || python bench/make_model.py runs/bench/llama-270m 270m
python -c "import json; from demo import demo_pairs; open('runs/bench/eval4.jsonl', 'w').writelines(json.dumps(p) + '\n' for p in demo_pairs('eval')[:4])"
for mode in sharded unsharded; do
  flag=$([ $mode = unsharded ] && echo --unsharded-grad-accumulation || true)
  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 train_dpo.py --device cpu --model runs/bench/llama-270m \
      --batch-size 8 --micro-batch-size 1 --max-steps 3 --lr 1e-5 --eval-data runs/bench/eval4.jsonl --no-eval-before --num-samples 0 \
      --out-dir runs/bench/accum-$mode --cache-dir runs/bench/cache $flag 2>&1 | grep "peak host memory during"
  python bench/steady.py runs/bench/accum-$mode/metrics.jsonl 8
done
