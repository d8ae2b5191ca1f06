#!/usr/bin/env bash
# Whole-process wall time of this repo, the plain loop and TRL on the same model, data, batch and steps, 3
# interleaved rounds; every run ends with its trained model written in Hugging Face format. From the repo root:
#   python bench/make_model.py runs/bench/llama-60m 60m
#   python -c "import json; from demo import demo_pairs; open('runs/bench/demo.jsonl', 'w').writelines(json.dumps(p) + '\n' for p in demo_pairs('train'))"
#   python3 -m venv runs/trlvenv && runs/trlvenv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0
#   bash bench/rounds.sh && cat runs/bench/times.txt
# PRECISIONS="fp32" runs fp32 alone (on a CPU without native bf16, whose bf16 figures say nothing).
set -u
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/llama-60m D=runs/bench/demo.jsonl S=20 B=8 T=runs/bench/times.txt O=runs/bench
for round in 1 2 3; do
  for p in ${PRECISIONS:-fp32 bf16}; do
    /usr/bin/time -a -o $T -f "ours $p %e" $PY train_dpo.py --model $M --data $D --max-steps $S --batch-size $B \
        --lr 1e-5 --precision $p --out-dir $O/ours-$p-$round --no-eval-before --num-samples 0 > $O/ours-$p-$round.log 2>&1
    /usr/bin/time -a -o $T -f "plain $p %e" $PY bench/plain_dpo.py $M $D $S $B $p $O/plain-$p-final \
        > $O/plain-$p-$round.log 2>&1
    /usr/bin/time -a -o $T -f "trl $p %e" $TRL_PY bench/trl_dpo.py $M $D $S $B $p $O/trl-$p-final \
        > $O/trl-$p-$round.log 2>&1
  done
done
