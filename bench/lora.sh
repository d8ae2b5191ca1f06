#!/usr/bin/env bash
# LoRA against full fine-tuning (this repo) and against TRL's DPOTrainer with a peft_config: whole-process wall
# time and peak memory (max RSS), same model, data, batch and steps as bench/rounds.sh, rank 16, alpha 16,
# every linear layer in the blocks, ROUNDS interleaved rounds (default 3). From the repo root, after rounds.sh's
# setup lines and runs/trlvenv/bin/pip install peft==0.21.2:
#   bash bench/lora.sh && cat runs/bench/lora.txt
set -u
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=${M:-runs/bench/llama-60m} D=runs/bench/demo.jsonl S=${S:-20} B=8 T=${T:-runs/bench/lora.txt} O=runs/bench
for round in $(seq ${ROUNDS:-3}); do
  for p in ${PRECISIONS:-fp32 bf16}; do
    for rank in 0 16; do
      /usr/bin/time -a -o $T -f "ours lora=$rank $p %e s %M KB" $PY train_dpo.py --model $M --data $D --max-steps $S \
          --batch-size $B --lr 1e-5 --precision $p --lora-rank $rank --out-dir $O/lora-$rank-$p --no-eval-before \
          --num-samples 0 > $O/lora-$rank-$p-$round.log 2>&1
    done
    /usr/bin/time -a -o $T -f "trl lora=16 $p %e s %M KB" $TRL_PY bench/trl_dpo.py $M $D $S $B $p $O/trl-lora-$p 16 \
        > $O/trl-lora-$p-$round.log 2>&1
  done
done
