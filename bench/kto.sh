#!/usr/bin/env bash
# KTO against TRL 1.16's KTOTrainer: completions per second between the first and the last of 20 steps, the
# same model (the 60M Llama), data and batch (8 completions a step), in fp32 and bf16, 3 interleaved rounds,
# KL term on (its mismatched completions computed by both). Two files of the demo's reviews as unpaired rows:
# k1, one completion per prompt (TRL's shape), and k2, each prompt's two reviews on adjacent lines (here one
# row of 2, so 4 rows a step). Also the model FLOPs per completion of each, ours as logged, TRL's from its
# padded batches. From the repo root, after bench/rounds.sh's three setup lines:
#   bash bench/kto.sh && cat runs/bench/kto-times.txt
# PRECISIONS="fp32" runs fp32 alone (on a CPU without native bf16, whose bf16 figures say nothing).
set -u
PY=${PY:-python} TRL_PY=${TRL_PY:-runs/trlvenv/bin/python}
M=runs/bench/llama-60m O=runs/bench/kto T=runs/bench/kto-times.txt S=20
mkdir -p $O
$PY - $O <<'PYEOF'
import json, sys
from demo import demo_pairs
pairs = list({p["prompt"]: p for p in demo_pairs("train")}.values())  # distinct prompts
def write(name, rows):
    open(f"{sys.argv[1]}/{name}.jsonl", "w").writelines(json.dumps(r) + "\n" for r in rows)
write("k1", [{"prompt": p["prompt"], "completion": p[("chosen", "rejected")[i % 2]], "label": i % 2 == 0} for i, p in enumerate(pairs)])
write("k2", [{"prompt": p["prompt"], "completion": p[s], "label": s == "chosen"} for p in pairs for s in ("chosen", "rejected")])
PYEOF
for round in 1 2 3; do
  for p in ${PRECISIONS:-fp32 bf16}; do
    for f in k1 k2; do
      rows=8 && [ $f = k2 ] && rows=4
      $PY train_dpo.py --model $M --data $O/$f.jsonl --loss kto --max-steps $S --batch-size $rows --lr 1e-5 \
          --precision $p --out-dir $O/ours-$f-$p-$round --cache-dir $O/cache --no-eval-before --num-samples 0 \
          > $O/ours-$f-$p-$round.log 2>&1
      echo "ours $f $p $($PY bench/steady.py $O/ours-$f-$p-$round/metrics.jsonl 8)" >> $T
      $TRL_PY bench/trl_prefs.py kto $M $O/$f.jsonl $S 8 $p $O/trl-$f-$p-$round > $O/trl-$f-$p-$round.log 2>&1
      echo "trl $f $p $(tail -1 $O/trl-$f-$p-$round.log)" >> $T
    done
  done
done
# Model FLOPs per completion: ours from metrics.jsonl; TRL's from its batches of 8 lines in file order, padded
# to their longest, each the policy's forward and backward (3 forwards) and the reference's forward on the
# completions, and a forward of each on the mismatched ones (the completions rotated by one).
$PY - $M $O >> $T <<'PYEOF'
import json, sys
import transformers
import metrics
model_dir, out = sys.argv[1], sys.argv[2]
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
coefficients = metrics.flop_coefficients(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
for f in ("k1", "k2"):
    rows = [json.loads(line) for line in open(f"{out}/{f}.jsonl")][: 8 * 20]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    completions = [tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    trl = 0.0
    for s in range(0, len(rows), 8):
        p, c = prompts[s : s + 8], completions[s : s + 8]
        width = max(len(a) + len(b) for a, b in zip(p, c))
        kl = max(len(a) + len(b) for a, b in zip(p, c[-1:] + c[:-1]))
        trl += 4 * metrics.forward_flops(coefficients, 8, width, 8 * width)
        trl += 2 * metrics.forward_flops(coefficients, 8, kl, 8 * kl)
    ours = [json.loads(line) for line in open(f"{out}/ours-{f}-fp32-1/metrics.jsonl")]
    ours = sum(r["flops"] for r in ours if r["split"] == "train")
    print(f"flops per completion {f}: ours {ours / len(rows):.3g}, trl {trl / len(rows):.3g}, ratio {trl / ours:.2f}")
PYEOF
