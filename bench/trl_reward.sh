#!/usr/bin/env bash
# --loss bradley_terry against TRL 1.16's RewardTrainer: every step's loss and gradient norm, same
# reward model (runs/bench/llama-60m with a scalar head drawn once, saved, so that both start from
# it), one batch holding all the data (both see the same pairs each step), fp32, the same linear
# learning rate from 5e-4; with shared rows (the default) and separate ones, with and without
# margins and the centering term. From the repo root, after bench/rounds.sh's three setup lines:
#   bash bench/trl_reward.sh && cat runs/bench/reward-trl.txt
set -eu
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/llama-60m O=runs/bench/reward-trl T=runs/bench/reward-trl.txt S=4
mkdir -p $O && : > $T
# The demo's first 8 pairs, without and with margins; the 60M Llama with a new scalar head.
$PY - $M $O <<'PYEOF'
import json, sys
import torch, transformers
from demo import demo_pairs
pairs = demo_pairs("train")[:8]
open(f"{sys.argv[2]}/pairs.jsonl", "w").writelines(json.dumps(p) + "\n" for p in pairs)
open(f"{sys.argv[2]}/margins.jsonl", "w").writelines(
    json.dumps({**p, "margin": 0.25 * i}) + "\n" for i, p in enumerate(pairs)
)
torch.manual_seed(0)
model = transformers.AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=1)
model.save_pretrained(f"{sys.argv[2]}/rm")
transformers.AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(f"{sys.argv[2]}/rm")
PYEOF
compare() {  # name: every step's loss and grad norm, ours/TRL's, and the largest relative gap
  $PY - "$1" $O/ours-$1/metrics.jsonl $O/trl-$1/log_history.json >> $T <<'PYEOF'
import json, sys
ours = [r for r in map(json.loads, open(sys.argv[2])) if r["split"] == "train"]
trl = [r for r in json.load(open(sys.argv[3])) if "loss" in r]
for key in ("loss", "grad_norm"):
    pairs = [(a[key], b[key]) for a, b in zip(ours, trl)]
    gap = max(abs(a - b) / abs(b) for a, b in pairs)
    print(sys.argv[1], key, " ".join(f"{a:.6g}/{b:.6g}" for a, b in pairs), "max rel diff %.1e" % gap)
PYEOF
}
run() {  # name, data, this repo's flags, TRL's arguments as JSON
  $PY train_dpo.py --model $O/rm --data $O/$2.jsonl --loss bradley_terry --max-steps $S \
      --batch-size 8 --lr 5e-4 --warmup-steps 0 --lr-schedule linear --out-dir $O/ours-$1 \
      --cache-dir $O/cache --no-eval-before $3 > $O/ours-$1.log 2>&1
  TRL_ARGS="{\"learning_rate\": 5e-4${4:+, $4}}" $TRL_PY bench/trl_prefs.py reward $O/rm \
      $O/$2.jsonl $S 8 fp32 $O/trl-$1 > $O/trl-$1.log 2>&1
  compare $1
}
echo "step 1..$S as ours/TRL's" >> $T
run shared pairs ""
run separate pairs "--no-share-prompt"
run margins margins ""
run center pairs "--center-rewards-coefficient 0.01" '"center_rewards_coefficient": 0.01'
run margins_center_separate margins "--no-share-prompt --center-rewards-coefficient 0.01" \
    '"center_rewards_coefficient": 0.01'
