#!/usr/bin/env bash
# Each objective option against TRL 1.16's DPOTrainer with the same option: step-1 loss and gradient norm, and the
# step-2 loss (after one AdamW step), same model, one batch of 8 pairs (both trainers see the same pairs each step),
# fp32, lr 1e-5 held for step 1. From the repo root, after bench/rounds.sh's three setup lines:
#   bash bench/trl_objectives.sh && cat runs/bench/objectives.txt
set -eu
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/llama-60m D=runs/bench/pairs-8.jsonl O=runs/bench/objectives T=runs/bench/objectives.txt
mkdir -p $O && head -8 runs/bench/demo.jsonl > $D && : > $T
compare() {  # name: this repo's metrics.jsonl against TRL's log_history.json, one line
  $PY - "$1" $O/ours-$1/metrics.jsonl $O/trl-$1/log_history.json >> $T <<'PYEOF'
import json, sys
ours = [r for r in map(json.loads, open(sys.argv[2])) if r["split"] == "train"]
trl = [r for r in json.load(open(sys.argv[3])) if "loss" in r]
pairs = [(ours[0]["loss"], trl[0]["loss"]), (ours[0]["grad_norm"], trl[0]["grad_norm"]), (ours[1]["loss"], trl[1]["loss"])]
print(sys.argv[1], " ".join(f"{a:.6f}/{b:.6f}" for a, b in pairs), "max rel diff %.1e" % max(abs(a - b) / abs(b) for a, b in pairs))
PYEOF
}
run() {  # name, this repo's flags, TRL's DPOConfig arguments as JSON
  $PY train_dpo.py --model $M --data $D --max-steps 2 --batch-size 8 --lr 1e-5 --warmup-steps 0 --out-dir $O/ours-$1 \
      --cache-dir $O/cache --no-eval-before --num-samples 0 $2 > $O/ours-$1.log 2>&1
  TRL_ARGS="$3" $TRL_PY bench/trl_dpo.py $M $D 2 8 fp32 $O/trl-$1 > $O/trl-$1.log 2>&1
  compare $1
}
echo "option: step-1 loss, step-1 grad norm, step-2 loss as ours/TRL's" >> $T
run dpo "" '{}'
run mix "--loss dpo --loss ipo --loss sft --loss-weights 1 --loss-weights 0.5 --loss-weights 0.25" \
    '{"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [1, 0.5, 0.25]}'
run wpo "--use-weighting" '{"use_weighting": true}'
run ld "--ld-alpha 0.5" '{"ld_alpha": 0.5}'
run forward_kl "--f-divergence-type forward_kl" '{"f_divergence_type": "forward_kl"}'
run js "--f-divergence-type js_divergence" '{"f_divergence_type": "js_divergence"}'
run alpha "--f-divergence-type alpha_divergence --f-alpha-divergence-coef 0.3" \
    '{"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}'
run tr_dpo "--sync-ref-model --ref-model-sync-steps 1 --ref-model-mixup-alpha 0.6" \
    '{"sync_ref_model": true, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.6}'
