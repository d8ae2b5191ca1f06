#!/usr/bin/env bash
# Pairs per second of K scored responses per prompt in one row, each response scored once, against the
# same pairs written out as a pair file (each response scored once per pair it is in), with and without
# --share-prompt, bf16 on the CPU, the four runs interleaved within each round. Two shapes
# (bench/make_rows.py): uf4, K = 4 with all 6 pairs, responses about as long as the prompt; long5, K = 5
# with best-vs-rest (4 pairs), long prompts. Each step trains on the same pairs either way: a K file's
# batch is BATCH rows, the pair file's BATCH x its pairs per row. From the repo root:
#   python bench/make_model.py runs/bench/llama-60m 60m
#   bash bench/listwise.sh && cat runs/bench/listwise.txt
# Each line: shape layout data round, then bench/steady.py's figures over pairs (steady_pairs_per_s is the
# throughput compared). ROUNDS, STEPS, BATCH, MODEL, PRECISION and SHAPES (say SHAPES=uf4:all:6) override
# the defaults. PAIR_MICRO=N: the pair files' micro-batches hold the pairs of N prompts (N x pairs per row;
# default the whole batch, one forward per step as the K rows take). With TRL=PYTHON (a python with
# trl==1.16.0 installed), TRL's DPOTrainer on each pair file too (bench/trl_dpo.py).
set -eu
M=${MODEL:-runs/bench/llama-60m} B=${BATCH:-2} S=${STEPS:-4} P=${PRECISION:-bf16}
O=runs/bench/listwise T=runs/bench/listwise.txt
mkdir -p $O
python bench/make_rows.py $O/uf4 uf4 all
python bench/make_rows.py $O/long5 long5 best-vs-rest
for round in $(seq ${ROUNDS:-2}); do
  for shape in ${SHAPES:-uf4:all:6 long5:best-vs-rest:4}; do
    IFS=: read -r name pairs per_row <<< "$shape"
    for layout in share-prompt no-share-prompt; do
      for data in rows pairs; do
        out=$O/$name-$layout-$data
        file=$O/$name.jsonl batch=$B micro=$B
        if [ $data = pairs ]; then
          file=$O/$name-pairs.jsonl batch=$((B * per_row)) micro=$((${PAIR_MICRO:-$B} * per_row))
        fi
        rm -rf $out
        python train_dpo.py --model $M --data $file --pairs $pairs --$layout --max-steps $S \
            --batch-size $batch --micro-batch-size $micro --lr 1e-5 --precision $P --max-length 1024 \
            --max-prompt-length 768 --out-dir $out --cache-dir $O/cache --no-eval-before --num-samples 0 \
            > $out.log 2>&1
        echo "$name $layout $data $round $(python bench/steady.py $out/metrics.jsonl $((B * per_row)))" >> $T
      done
    done
    if [ -n "${TRL:-}" ]; then
      out=$O/$name-trl
      rm -rf $out
      TRL_ARGS='{"max_length": 1024}' \
          $TRL bench/trl_dpo.py $M $O/$name-pairs.jsonl $S $((B * per_row)) $P $out > $out.log 2>&1
      echo "$name trl pairs $round $(tail -1 $out.log)" >> $T
    fi
  done
done
