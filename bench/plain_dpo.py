# A careful plain DPO loop, for comparison: one process, no FSDP, full float32 log-softmax over all
# logits, autocast for bf16; saves the model at the end.
import copy
import json
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

# usage: python bench/plain_dpo.py MODEL DATA STEPS BATCH fp32|bf16 OUT_DIR
model_dir, data_path, precision, out = sys.argv[1], sys.argv[2], sys.argv[5], sys.argv[6]
steps, batch = int(sys.argv[3]), int(sys.argv[4])
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(model_dir)
policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
reference = copy.deepcopy(policy).eval().requires_grad_(False)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
pairs = [json.loads(line) for line in open(data_path)]


def encode(prompt, response):
    p = tok(prompt, add_special_tokens=False).input_ids
    r = tok(response, add_special_tokens=False).input_ids + [tok.eos_token_id]
    return p + r, [-100] * len(p) + r


def collate(rows):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = (
            torch.tensor(x),
            torch.tensor(y),
            1,
        )
    return ids, labels, mask


def logps(model, ids, labels, mask):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    labels = labels[:, 1:]
    lp = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return (lp * (labels != -100)).sum(-1)


t0 = time.perf_counter()
for step in range(steps):
    chunk = pairs[step * batch : (step + 1) * batch]
    rows = [encode(p["prompt"], p["chosen"]) for p in chunk] + [
        encode(p["prompt"], p["rejected"]) for p in chunk
    ]
    ids, labels, mask = collate(rows)
    with torch.no_grad():
        ref_c, ref_r = logps(reference, ids, labels, mask).chunk(2)
    pol_c, pol_r = logps(policy, ids, labels, mask).chunk(2)
    loss = -F.logsigmoid(0.1 * ((pol_c - ref_c) - (pol_r - ref_r))).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step + 1} loss {loss.item():.4f} {time.perf_counter() - t0:.1f}s", flush=True)
policy.save_pretrained(out)  # like the others, end with the model on disk
