#!/usr/bin/env bash
# On-policy rounds (iterative DPO), from the repo root. Each round samples K responses for each prompt
# of its slice of the data from the current model, scores them (generate.py), trains on those rows from
# the current model, which is also the reference (train_dpo.py), and exports; the next round starts from
# that export. Every round keeps its rows, metrics and export in $OUT/round-N. Run it again after an
# interruption: finished rounds are skipped, written rows are kept, and training resumes from its last
# checkpoint.
#   bash bench/onpolicy.sh                  # the demo: 3 rounds of 256 prompts from its SFT stage
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=hub:HuggingFaceH4/ultrafeedback_binarized:train_prefs \
#     REWARD=Skywork/Skywork-Reward-V2-Llama-3.1-8B NPROC=8 ROUNDS=3 PROMPTS=20000 bash bench/onpolicy.sh
# Settings: MODEL (round 1's), DATA (prompts), OUT, ROUNDS, PROMPTS (per round), K, REWARD (see
# generate.py --help), NPROC (ranks), GEN_FLAGS and TRAIN_FLAGS (more flags for each round's commands).
set -euo pipefail
MODEL=${MODEL:-runs/cache/demo-sft/final} DATA=${DATA:-runs/cache/demo-train.jsonl} OUT=${OUT:-runs/onpolicy}
ROUNDS=${ROUNDS:-3} PROMPTS=${PROMPTS:-256} K=${K:-4} REWARD=${REWARD:-demo} NPROC=${NPROC:-1}
PY=${PY:-python}

launch() {
  if [ "$NPROC" = 1 ]; then $PY "$@"; else $PY -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"; fi
}

# The demo's SFT stage and prompt files, as train_dpo.py's default run writes them, once.
if [ "$MODEL" = runs/cache/demo-sft/final ] && [ ! -d "$MODEL" ]; then
  resume=()
  if [ -f runs/cache/demo-sft/checkpoints/latest ]; then resume=(--resume latest); fi
  launch train_dpo.py --loss sft --data demo:sft --epochs 6 --out-dir runs/cache/demo-sft --num-samples 0 \
    --no-eval-before "${resume[@]}"
fi
for round in $(seq 1 "$ROUNDS"); do
  dir=$OUT/round-$round
  if [ ! -d "$dir/final" ]; then
    echo "round $round of $ROUNDS: from $MODEL"
    if [ ! -f "$dir/rows.jsonl" ]; then
      launch generate.py --model "$MODEL" --data "$DATA" --out "$dir/rows.jsonl" --num-generations "$K" \
        --reward "$REWARD" --skip-prompts $(((round - 1) * PROMPTS)) --max-prompts "$PROMPTS" \
        --seed "$round" ${GEN_FLAGS:-}
    fi
    resume=()
    if [ -f "$dir/checkpoints/latest" ]; then resume=(--resume latest); fi
    launch train_dpo.py --model "$MODEL" --data "$dir/rows.jsonl" --out-dir "$dir" --seed "$round" \
      "${resume[@]}" ${TRAIN_FLAGS:-}
  fi
  MODEL=$dir/final
done
echo "on-policy rounds done: $MODEL"
