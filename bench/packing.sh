#!/usr/bin/env bash
# Padded rows against --packing, with and without --group-by-length: same model, data and settings as
# bench/rounds.sh (fp32, one process), ROUNDS interleaved rounds (default 1). From the repo root, after
# rounds.sh's first two setup lines:
#   bash bench/packing.sh && cat runs/bench/packing.txt
set -eu
M=runs/bench/llama-60m D=runs/bench/demo.jsonl T=runs/bench/packing.txt O=runs/bench
for round in $(seq ${ROUNDS:-1}); do
  for flags in "" "--packing" "--no-group-by-length" "--no-group-by-length --packing"; do
    name=pack$(echo "$flags" | tr -d ' -')
    /usr/bin/time -a -o $T -f "[$flags] %e s" python train_dpo.py --model $M --data $D --max-steps 20 --batch-size 8 \
        --lr 1e-5 --precision fp32 $flags --out-dir $O/$name --no-eval-before --num-samples 0 > $O/$name-$round.log 2>&1
    python bench/steady.py $O/$name/metrics.jsonl 8 >> $T
    python -c "import json,statistics as s; r=[json.loads(l) for l in open('$O/$name/metrics.jsonl')]; r=[x for x in r if x['split']=='train'][2:]; print('median step %.3f s, padding_efficiency %.3f' % (s.median(8/x['pairs_per_s'] for x in r), s.mean(x['padding_efficiency'] for x in r)))" >> $T
  done
done
