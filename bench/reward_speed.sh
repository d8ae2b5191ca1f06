#!/usr/bin/env bash
# Whole-process wall time of a reward model's training here (--loss bradley_terry, each pair's prompt
# computed once) against TRL 1.16's RewardTrainer (prompt + response per sequence, the prompt twice),
# same model (the 60M Llama with a scalar head, bench/trl_reward.sh makes it), same rows (hh: prompts
# about 5x the responses, bench/make_pairs.py), batch and steps, bf16, 3 interleaved rounds. From the
# repo root, after bench/trl_reward.sh and `python bench/make_pairs.py runs/bench/hh.jsonl hh`:
#   bash bench/reward_speed.sh && cat runs/bench/reward-speed.txt
# PRECISIONS="fp32" runs fp32 alone (on a CPU without native bf16, whose bf16 figures say nothing).
set -u
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/reward-trl/rm D=runs/bench/hh.jsonl S=16 B=8 T=runs/bench/reward-speed.txt O=runs/bench/reward-speed
mkdir -p $O
for round in 1 2 3; do
  for p in ${PRECISIONS:-bf16}; do
    /usr/bin/time -a -o $T -f "ours $p %e" $PY train_dpo.py --model $M --data $D --loss bradley_terry \
        --max-steps $S --batch-size $B --lr 1e-5 --precision $p --max-length 1024 --max-prompt-length 768 \
        --out-dir $O/ours-$p-$round --cache-dir $O/cache-$round --no-eval-before > $O/ours-$p-$round.log 2>&1
    TRL_ARGS='{"max_length": 1024}' /usr/bin/time -a -o $T -f "trl $p %e" $TRL_PY bench/trl_prefs.py reward \
        $M $D $S $B $p $O/trl-$p-$round > $O/trl-$p-$round.log 2>&1
  done
done
