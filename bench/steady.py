"""Steady-state figures of a train_dpo.py run from its metrics.jsonl: pairs/s between the first and
the last train step (start-up and the first step left out), mean tokens/s, padding efficiency and
MFU after step 1, peak memory, last loss. usage: python bench/steady.py METRICS_JSONL BATCH_SIZE
(prints one JSON line)"""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train, batch = [r for r in rows if r["split"] == "train"], int(sys.argv[2])
first, last, rest = train[0], train[-1], train[1:] or train


def mean(key):
    return sum(r.get(key, 0) for r in rest) / len(rest)


print(
    json.dumps(
        {
            "steps": len(train),
            "steady_pairs_per_s": round(
                (last["step"] - first["step"]) * batch / (last["elapsed_s"] - first["elapsed_s"]), 2
            ),
            "tokens_per_s": round(mean("tokens_per_s")),
            "padding_efficiency": round(mean("padding_efficiency"), 3),
            "mfu": round(mean("mfu"), 3),
            "peak_gb": round(max(r["peak_mem_gb"] for r in train), 2),
            "last_loss": round(last["loss"], 4),
        }
    )
)
