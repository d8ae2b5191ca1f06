#!/usr/bin/env bash
# The iterative recipe closed on the demo, from the repo root: the demo's SFT stage, then a reward model
# trained on the demo's pairs from it (--loss bradley_terry, its held-out accuracy on the 256 held-out
# pairs), its agreement with the demo's ground-truth scorer on the SFT model's samples (4 per held-out
# prompt, both scorers on the same samples: of the pairs of samples the ground truth ranks, the share the
# reward model ranks the same way), and one on-policy round (bench/onpolicy.sh: 512 prompts, K = 4) scored
# by it against one scored by the ground truth, each judged alike by the ground truth on 4 samples of each
# held-out prompt, as bench/onpolicy_demo.sh judges.
#   bash bench/reward_demo.sh && cat runs/bench/reward-demo/report.txt
set -eu
PY=${PY:-python} O=runs/bench/reward-demo SFT=runs/cache/demo-sft/final
mkdir -p $O
# The SFT stage, as bench/onpolicy.sh makes it; then the reward model from it.
ROUNDS=0 PY=$PY bash bench/onpolicy.sh > /dev/null
if [ ! -d $O/rm/final ]; then
  $PY train_dpo.py --model $SFT --data runs/cache/demo-train.jsonl --eval-data runs/cache/demo-eval.jsonl \
    --loss bradley_terry --lr ${RM_LR:-1e-4} --batch-size 32 --eval-every 16 --out-dir $O/rm > $O/rm.log
fi
for reward in demo $O/rm/final; do
  $PY generate.py --model $SFT --data runs/cache/demo-eval.jsonl --num-generations 4 --reward $reward \
    --out $O/sft-samples-$(basename $reward).jsonl > /dev/null
done
FLAGS="--lr 1e-4 --beta 0.5 --batch-size 32 --num-samples 0 --no-eval-before"
for reward in demo $O/rm/final; do
  OUT=$O/round-$(basename $reward) ROUNDS=1 PROMPTS=512 K=4 REWARD=$reward TRAIN_FLAGS="$FLAGS" PY=$PY \
    bash bench/onpolicy.sh > /dev/null
  $PY generate.py --model $O/round-$(basename $reward)/round-1/final --data runs/cache/demo-eval.jsonl \
    --num-generations 4 --reward demo --out $O/judged-$(basename $reward).jsonl > /dev/null
done
$PY - $O > $O/report.txt <<'PYEOF'
import itertools, json, sys
o = sys.argv[1]
evals = [r for r in map(json.loads, open(f"{o}/rm/metrics.jsonl")) if r.get("split") == "eval"]
print(f"reward model: held-out accuracy {evals[-1]['rewards/accuracies']:.3f} at step {evals[-1]['step']} "
      f"(step 0: {evals[0]['rewards/accuracies']:.3f}), 256 held-out pairs")
truth = [json.loads(l) for l in open(f"{o}/sft-samples-demo.jsonl")]
learned = [json.loads(l) for l in open(f"{o}/sft-samples-final.jsonl")]
assert [r["responses"] for r in truth] == [r["responses"] for r in learned], "not the same samples"
same = ranked = 0
for t, m in zip(truth, learned):
    for i, j in itertools.combinations(range(len(t["scores"])), 2):
        if t["scores"][i] != t["scores"][j]:
            ranked += 1
            same += (t["scores"][i] > t["scores"][j]) == (m["scores"][i] > m["scores"][j])
print(f"agreement with the ground truth on the SFT model's samples: {same / ranked:.3f} of {ranked} ranked pairs")
for name in ("demo", "final"):
    s = [x for l in open(f"{o}/judged-{name}.jsonl") for x in json.loads(l)["scores"]]
    who = "the ground truth" if name == "demo" else "the reward model"
    print(f"one on-policy round scored by {who}: {s.count(1.0) / len(s):.3f} preferred of {len(s)} samples")
s = [x for r in truth for x in r["scores"]]
print(f"the SFT stage: {s.count(1.0) / len(s):.3f} preferred of {len(s)} samples")
PYEOF
cat $O/report.txt
