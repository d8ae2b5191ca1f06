"""Extra peak host memory of log-probs, forward plus backward, on bf16 logits (8, 1024, 32000) with
300 prompt positions masked. Run each mode in a fresh process, from the repo root:
    python bench/logps_memory.py naive; python bench/logps_memory.py chunked"""

import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from logps import sequence_logps  # noqa: E402

torch.manual_seed(0)
B, T, V, P = 8, 1024, 32000, 300
logits = torch.randn(B, T, V, dtype=torch.bfloat16).requires_grad_()
labels = torch.randint(0, V, (B, T))
labels[:, :P] = -100


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


base, t0 = rss(), time.perf_counter()
if sys.argv[1] == "naive":
    logp = logits.float().log_softmax(-1)[:, :-1]
    mask = labels[:, 1:] != -100
    out = (logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1) * mask).sum(-1)
else:
    out = sequence_logps(logits, labels)
out.sum().backward()
print(
    f"{sys.argv[1]}: extra peak {rss() - base:.2f} GiB over the {logits.numel() * 2 / 2**30:.2f} "
    f"GiB logits, forward+backward {time.perf_counter() - t0:.1f} s"
)
