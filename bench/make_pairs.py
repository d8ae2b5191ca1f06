"""Made-up preference pairs of controlled lengths; only their lengths matter.
usage: python bench/make_pairs.py OUT.jsonl KIND
    big    100,000 pairs: prompts of 20-60 words, responses of 20-80 (the tokenization benchmark)
    gpu    4,096 pairs of about 900 byte-tokens (prompt ~100-400, responses ~60-400): the 1B GPU
           bench
    long   256 pairs of about 3.5k byte-tokens: the 1B GPU bench with 4k-token pairs
    hh, uf, tldr  64 pairs each in the shape of a prompt-sharing benchmark (bench/share_prompt.sh),
           byte-tokens: hh  HH-RLHF-like, long multi-turn prompts (~320) over short responses
           (~64, a fifth); uf  UltraFeedback-like, responses (~260) longer than prompts (~150);
           tldr  TL;DR-like, long posts (~500) and very short summaries (~45)
    tail   256 pairs of long-tailed lengths (the packing bench, bench/packing.sh): byte-token
           lengths drawn log-uniformly, prompts in [16, 2048], responses in [16, 1024]
"""

import math

import json
import random
import sys

WORDS = {
    "big": (
        "the a kettle lamp works well bad great broke fast value price quality service shipping box"
    ).split(),
    "gpu": (
        "the a of to and in is it that was for on are as with his they at be this from have or by "
        "one had not but what all were when we there can an your which their said if do will each "
        "about how up out them then she many some so these would other into has more her two like "
        "him see time could no make than first"
    ).split(),
}
WORDS["long"] = WORDS["hh"] = WORDS["uf"] = WORDS["tldr"] = WORDS["tail"] = WORDS["gpu"]
# kind: (seed, pairs, prompt words, response words)
KINDS = {
    "big": (0, 100_000, (20, 60), (20, 80)),
    "gpu": (1, 4096, (25, 90), (15, 90)),
    "long": (1, 256, (350, 450), (250, 330)),
    "hh": (2, 64, (65, 95), (10, 18)),
    "uf": (3, 64, (30, 48), (55, 75)),
    "tldr": (4, 64, (110, 140), (8, 14)),
    "tail": (5, 256, (16, 2048), (16, 1024)),
}

out, kind = sys.argv[1], sys.argv[2]
seed, n, prompt_words, response_words = KINDS[kind]
rng = random.Random(seed)


def salad(lo, hi):
    return " ".join(rng.choice(WORDS[kind]) for _ in range(rng.randint(lo, hi)))


def tail(lo, hi):
    """Words cut to a byte length drawn log-uniformly in [lo, hi]."""
    n = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    return salad(n // 2, n // 2)[:n]


with open(out, "w") as f:
    for i in range(n):
        if kind == "big":
            p, c, r = salad(*prompt_words), salad(*response_words), salad(*response_words)
            f.write(
                json.dumps({"prompt": f"Q{i}: {p}", "chosen": " " + c, "rejected": " " + r}) + "\n"
            )
        elif kind == "tail":
            p, c, r = tail(*prompt_words), tail(*response_words), tail(*response_words)
            f.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")
        else:
            f.write(
                json.dumps(
                    {
                        "prompt": salad(*prompt_words) + "\n",
                        "chosen": salad(*response_words),
                        "rejected": salad(*response_words),
                    }
                )
                + "\n"
            )
print(out, n, "pairs")
