#!/usr/bin/env bash
# Generation speed, from the repo root. First generate.py's sampler against Hugging Face's
# model.generate(num_return_sequences=K) and against itself with each prompt repeated K times before the
# prefill, on one unsharded model, at short and long prompts (bench/generate_speed.py); then generate.py's
# command line on 1 and 2 ranks (prompts dealt to the ranks, the model sharded), tokens per second from the
# sidecar it writes. Setup once:
#   python bench/make_model.py runs/bench/llama-60m 60m
set -eu
PY=${PY:-python} M=${M:-runs/bench/llama-60m} O=runs/bench/generate K=${K:-4} NEW=${NEW:-64}
mkdir -p $O
for prompt in 32 512; do
  $PY bench/generate_speed.py $M $prompt $K $NEW 8 3
done
# 32 prompts of about 60 and about 500 bytes (ByT5: a token per byte). The command line decodes what it samples,
# so it needs a model whose every row its tokenizer decodes: the demo's SFT stage (ByT5's 384 rows), not the
# 60M bench model (32000 rows).
CLI_MODEL=${CLI_MODEL:-runs/cache/demo-sft/final}
$PY - <<PYEOF
import json
for name, words in (("short", 12), ("long", 100)):
    with open("$O/prompts-" + name + ".jsonl", "w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": " ".join(f"word{i}-{j}" for j in range(words))[: words * 5]}) + "\n")
PYEOF
for prompts in short long; do
  for ranks in 1 2; do
    $PY -m torch.distributed.run --standalone --nproc_per_node=$ranks generate.py --model $CLI_MODEL \
      --data $O/prompts-$prompts.jsonl --out $O/rows-$prompts-$ranks.jsonl --num-generations $K \
      --max-new-tokens $NEW --reward demo > $O/generate-$prompts-$ranks.log 2>&1
    $PY -c "import json; m = json.load(open('$O/rows-$prompts-$ranks.jsonl.json')); print('generate.py, $prompts prompts, $ranks rank(s):', round(m['generated_tokens'] / m['seconds']), 'tokens/s')"
  done
done
