"""Made-up rows of K scored responses per prompt, and the same pairs written out as a pair file;
only their lengths matter. usage: python bench/make_rows.py OUT_PREFIX KIND PAIRS
    uf4    64 prompts, K = 4: prompts and responses of similar length (~40 words, ~170 byte-tokens
           each), UltraFeedback-like
    long5  64 prompts, K = 5: long prompts (~120 words) over short responses (~15 words)
Writes OUT_PREFIX.jsonl ({"prompt", "responses", "scores"}, distinct scores) and
OUT_PREFIX-pairs.jsonl (the pairs that --pairs PAIRS gives, as {"prompt", "chosen", "rejected"},
row after row)."""

import json
import random
import sys

sys.path.insert(0, ".")
from batches import row_pairs  # noqa: E402  (run from the repo root)

WORDS = (
    "the a of to and in is it that was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about how"
).split()
KINDS = {"uf4": (5, 64, 4, (35, 45), (35, 45)), "long5": (6, 64, 5, (110, 130), (12, 18))}

prefix, kind, pairs = sys.argv[1], sys.argv[2], sys.argv[3]
seed, n, k, prompt_words, response_words = KINDS[kind]
rng = random.Random(seed)


def salad(lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


rows = []
for _ in range(n):
    scores = [float(s) for s in rng.sample(range(10), k)]
    rows.append(
        {
            "prompt": salad(*prompt_words) + "\n",
            "responses": [salad(*response_words) for _ in range(k)],
            "scores": scores,
        }
    )
with open(f"{prefix}.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
with open(f"{prefix}-pairs.jsonl", "w") as f:
    for row in rows:
        for i, j in row_pairs(row["scores"], pairs):
            pair = {"prompt": row["prompt"], "chosen": row["responses"][i]}
            f.write(json.dumps({**pair, "rejected": row["responses"][j]}) + "\n")
print(prefix, n, "rows of", k, "and", len(row_pairs(rows[0]["scores"], pairs)), "pairs each")
