#!/usr/bin/env bash
# KTO, APO-zero-unpaired, CPO (with AlphaPO) and ORPO against TRL 1.16's KTOTrainer, CPOTrainer and
# ORPOTrainer: every step's loss, gradient norm and (KTO) KL, same model, one batch holding all the
# data (so both see the same rows each step, and TRL's KL pairs, made within a batch in file order,
# are ours), fp32, the same linear learning rate from 5e-4 (high enough that the policy leaves the
# reference and the KL estimate is not 0). From the repo root, after bench/rounds.sh's three setup
# lines:
#   bash bench/trl_kto.sh && cat runs/bench/kto-trl.txt
# ONLY="kto cpo_ipo" runs those alone.
set -eu
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/llama-60m O=runs/bench/kto-trl T=runs/bench/kto-trl.txt S=4
mkdir -p $O && : > $T
# The demo's first 8 pairs, and as unpaired rows: one completion per prompt (K = 1, labels
# alternating), and each prompt's two completions on adjacent lines (which this repo shares a row).
$PY - $O <<'PYEOF'
import json, sys
from demo import demo_pairs
pairs = demo_pairs("train")[:8]
def write(name, rows):
    open(f"{sys.argv[1]}/{name}.jsonl", "w").writelines(json.dumps(r) + "\n" for r in rows)
write("pairs", pairs)
write("k1", [{"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"], "label": i % 2 == 1} for i, p in enumerate(pairs)])
write("k2", [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in pairs[:4] for side in ("chosen", "rejected")])
PYEOF
compare() {  # name: every step's loss, grad norm and kl, ours/TRL's, and the largest relative gap
  $PY - "$1" $O/ours-$1/metrics.jsonl $O/trl-$1/log_history.json >> $T <<'PYEOF'
import json, sys
ours = [r for r in map(json.loads, open(sys.argv[2])) if r["split"] == "train"]
trl = [r for r in json.load(open(sys.argv[3])) if "loss" in r]
for key in ("loss", "grad_norm", "kl"):
    if key in trl[0]:
        pairs = [(a[key], b[key]) for a, b in zip(ours, trl)]
        gap = max((abs(a - b) / abs(b) for a, b in pairs if b), default=0)
        print(sys.argv[1], key, " ".join(f"{a:.6g}/{b:.6g}" for a, b in pairs), "max rel diff %.1e" % gap)
PYEOF
}
run() {  # name, data, batch rows (ours), TRL's trainer, this repo's flags, TRL's arguments as JSON
  case " ${ONLY:-$1} " in *" $1 "*) ;; *) return ;; esac
  $PY train_dpo.py --model $M --data $O/$2.jsonl --max-steps $S --batch-size $3 --lr 5e-4 --warmup-steps 0 \
      --lr-schedule linear --out-dir $O/ours-$1 --cache-dir $O/cache --no-eval-before --num-samples 0 $5 \
      > $O/ours-$1.log 2>&1
  TRL_ARGS="{\"learning_rate\": 5e-4${6:+, $6}}" $TRL_PY bench/trl_prefs.py $4 $M $O/$2.jsonl $S 8 fp32 $O/trl-$1 \
      > $O/trl-$1.log 2>&1
  compare $1
}
echo "step 1..$S as ours/TRL's" >> $T
run kto k1 8 kto "--loss kto"
run kto_shared k2 4 kto "--loss kto"
run kto_weights k1 8 kto "--loss kto --desirable-weight 1.3 --undesirable-weight 0.7" \
    '"desirable_weight": 1.3, "undesirable_weight": 0.7'
run apo_zero_unpaired k1 8 kto "--loss apo_zero_unpaired" '"loss_type": "apo_zero_unpaired"'
run cpo_sigmoid pairs 8 cpo "--ref none --loss dpo --loss sft"
run cpo_hinge pairs 8 cpo "--ref none --loss hinge --cpo-alpha 0.5" \
    '"loss_type": "hinge", "cpo_alpha": 0.5'
run cpo_ipo pairs 8 cpo "--ref none --loss ipo --loss sft" '"loss_type": "ipo"'
run cpo_simpo pairs 8 cpo "--loss simpo --loss sft --label-smoothing 0.1" '"loss_type": "simpo", "label_smoothing": 0.1'
run alphapo pairs 8 cpo "--loss simpo --alphapo-alpha 0.25" '"loss_type": "alphapo", "alpha": 0.25'
run orpo pairs 8 orpo "--loss orpo"
run orpo_beta pairs 8 orpo "--loss orpo --beta 0.5" '"beta": 0.5'
