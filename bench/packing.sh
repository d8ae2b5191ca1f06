#!/usr/bin/env bash
# Packed micro-batches (--packing, at most TOKENS tokens each, no padding) against padded ones of
# MICRO rows (each padded to its longest row), with length grouping (the default) and without, on
# long-tailed pairs
# (bench/make_pairs.py tail: prompts of 16 to 2,048 byte-tokens, responses of 16 to 1,024), the two
# interleaved within each round. From the repo root:
#   python bench/make_model.py runs/bench/llama-60m-4k 60m-4k
#   python bench/make_pairs.py runs/bench/tail.jsonl tail
#   bash bench/packing.sh && cat runs/bench/packing.txt
# Each line: layout, TOKENS or MICRO, grouping, round, then bench/steady.py's figures (tokens_per_s, the mean
# padding efficiency, the peak memory). ROUNDS, STEPS, BATCH, MICRO, TOKENS, GROUPINGS, PRECISION and MODEL
# override the defaults.
set -eu
M=${MODEL:-runs/bench/llama-60m-4k} B=${BATCH:-8} S=${STEPS:-3} O=runs/bench/packing T=runs/bench/packing.txt
mkdir -p $O
for round in $(seq ${ROUNDS:-1}); do
  for group in ${GROUPINGS:-group-by-length no-group-by-length}; do
  for layout in padded packed; do
    size="micro ${MICRO:-2}" flags="--micro-batch-size ${MICRO:-2}"
    if [ $layout = packed ]; then
      size="tokens ${TOKENS:-3072}" flags="--packing --micro-batch-tokens ${TOKENS:-3072}"
    fi
    out=$O/$layout-$group
    rm -rf $out
    python train_dpo.py --model $M --data runs/bench/tail.jsonl $flags --$group --max-steps $S \
        --batch-size $B --lr 1e-5 --precision ${PRECISION:-fp32} --max-length 3072 \
        --max-prompt-length 2048 --out-dir $out --cache-dir $O/cache --no-eval-before \
        --num-samples 0 > $out.log 2>&1
    echo "$layout $size $group $round $(python bench/steady.py $out/metrics.jsonl $B)" >> $T
  done
  done
done
