#!/usr/bin/env bash
# Training throughput with each pair's prompt shared ([prompt | chosen | rejected] in one row, the
# default) against separate rows (--no-share-prompt), on three shapes of pairs (bench/make_pairs.py:
# hh, uf, tldr), in bf16 and fp32, the two layouts interleaved within each round. From the repo root:
#   python bench/make_model.py runs/bench/llama-60m 60m
#   for k in hh uf tldr; do python bench/make_pairs.py runs/bench/$k.jsonl $k; done
#   bash bench/share_prompt.sh && cat runs/bench/share.txt
# Each line: shape precision layout round, then bench/steady.py's figures (steady_pairs_per_s is the
# throughput compared). ROUNDS, STEPS, BATCH, MODEL and PRECISIONS override the defaults.
set -eu
M=${MODEL:-runs/bench/llama-60m} B=${BATCH:-4} S=${STEPS:-6} O=runs/bench/share T=runs/bench/share.txt
mkdir -p $O
for round in $(seq ${ROUNDS:-2}); do
  for shape in hh uf tldr; do
    for p in ${PRECISIONS:-bf16 fp32}; do
      for layout in share-prompt no-share-prompt; do
        out=$O/$shape-$p-$layout
        rm -rf $out
        python train_dpo.py --model $M --data runs/bench/$shape.jsonl --$layout --max-steps $S \
            --batch-size $B --lr 1e-5 --precision $p --max-length 1024 --max-prompt-length 768 \
            --out-dir $out --cache-dir $O/cache --no-eval-before --num-samples 0 > $out.log 2>&1
        echo "$shape $p $layout $round $(python bench/steady.py $out/metrics.jsonl $B)" >> $T
      done
    done
  done
done
