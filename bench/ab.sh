#!/usr/bin/env bash
# Whole-process wall time of this tree against an earlier commit (checked out as a git worktree under runs/),
# same model, data and settings as bench/rounds.sh, interleaved over 3 rounds (ROUNDS=n for n). From the repo root, after
# rounds.sh's first two setup lines:
#   bash bench/ab.sh 67aafbe && cat runs/bench/ab.txt
set -eu
REV=$1 OLD=runs/ab-$1 M=runs/bench/llama-60m D=runs/bench/demo.jsonl T=runs/bench/ab.txt O=runs/bench
[ -d "$OLD" ] || git worktree add --detach "$OLD" "$REV"
for round in $(seq ${ROUNDS:-3}); do
  for p in fp32 bf16; do
    for side in new old; do
      dir=.; [ "$side" = old ] && dir=$OLD
      /usr/bin/time -a -o $T -f "$side $p %e" python $dir/train_dpo.py --model $M --data $D --max-steps 20 \
          --batch-size 8 --lr 1e-5 --precision $p --out-dir $O/ab-$side-$p --cache-dir $O/ab-cache-$side \
          --no-eval-before --num-samples 0 > $O/ab-$side-$p-$round.log 2>&1
    done
  done
done
