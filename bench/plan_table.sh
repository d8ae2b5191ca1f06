#!/usr/bin/env bash
# The README's sizing table: train_dpo.py --plan (computed on this machine, no GPU, no weights) for
# Llama-3.1 8B and 70B on 8 GPUs (FSDP) and 16 (HSDP, 2 replicas of 8), pairs of 1024 and 4096
# tokens, plain, with activation checkpointing, and LoRA (rank 16) with it. One JSON line each: the
# peak at micro-batch 1 and the largest micro-batch of 4 (or 2) rows per GPU that fits 80 GB.
# usage, from the repo root: bash bench/plan_table.sh > plan_table.jsonl
set -euo pipefail
PY=${PY:-python}
for model in llama-3.1-8b llama-3.1-70b; do
  for gpus in 8 16; do
    replicas=$((gpus / 8))
    for length in 1024 4096; do
      for variant in plain ac lora; do
        extra=()
        [ "$variant" != plain ] && extra+=(--activation-checkpointing)
        [ "$variant" = lora ] && extra+=(--lora-rank 16)
        out=$($PY train_dpo.py --plan --model bench/configs/$model --plan-gpus $gpus --replicas $replicas \
          --precision bf16 --max-length $length --batch-size 32 --gpu-memory 80 \
          --cache-dir runs/cache/plan-table --out-dir runs/plan-table "${extra[@]}" 2>&1)
        peak1=$(echo "$out" | awk '$1 == "1" && NF >= 3 {print $2; exit}')
        fits=$(echo "$out" | awk '$1 ~ /^[0-9]+$/ && $3 == "yes" {m = $1} END {print m ? m : 0}')
        echo "{\"model\": \"$model\", \"gpus\": $gpus, \"length\": $length, \"variant\": \"$variant\", \"peak_gb_micro1\": $peak1, \"largest_fitting_micro\": $fits}"
      done
    done
  done
done
