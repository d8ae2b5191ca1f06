#!/usr/bin/env bash
# The 1B-shape DPO benchmark on one GPU: a random-init Llama-3.2-1B shape (1.24B parameters, 128256-row vocabulary,
# tied), 4096 made-up pairs of about 900 tokens, bf16, batch 32, micro-batch 8, max length 1024, 20 steps.
# From the repo root on a GPU machine (the first run builds the model, ~5 GB, and the pairs under runs/bench/):
#   bash bench/gpu.sh [extra train_dpo.py flags, e.g. --activation-checkpointing]
set -euo pipefail
mkdir -p runs/bench
[ -f runs/bench/llama-1b/config.json ] || python bench/make_model.py runs/bench/llama-1b 1b
[ -f runs/bench/pairs-gpu.jsonl ] || python bench/make_pairs.py runs/bench/pairs-gpu.jsonl gpu
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
torchrun --standalone --nproc_per_node=1 train_dpo.py --precision bf16 --model runs/bench/llama-1b \
    --data runs/bench/pairs-gpu.jsonl --batch-size 32 --micro-batch-size 8 --max-length 1024 --max-prompt-length 512 \
    --max-steps 20 --lr 1e-6 --num-samples 0 --no-eval-before --out-dir runs/bench/gpu --cache-dir runs/bench/cache "$@"
python bench/steady.py runs/bench/gpu/metrics.jsonl 32
