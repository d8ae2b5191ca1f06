"""Two ranks prepare one file's tokens as a run does: time, and memory before and after (RssAnon:
the process's own; RssFile: mapped file pages, shared between ranks), then peak RSS. From the repo
root:
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/tokenize_memory.py PAIRS.jsonl
tiny CACHE_DIR"""

import os
import resource
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import data  # noqa: E402
import fsdp_setup  # noqa: E402

dist.init_process_group("gloo")


def mem():
    return {
        k: int(v.split()[0]) / 2**20
        for k, v in (line.split(":") for line in open("/proc/self/status"))
        if k in ("RssAnon", "RssFile")
    }


before, tok, t0 = mem(), data.load_tokenizer(sys.argv[2]), time.perf_counter()
config = data.DataConfig(
    data=(sys.argv[1],), max_length=1024, max_prompt_length=512, cache_dir=sys.argv[3]
)
train, _, _ = data.load_tokens(fsdp_setup.on_rank0(data.tokenize_to_cache, config, tok))
t = time.perf_counter() - t0
sum(len(train[i]["chosen"]) for i in range(len(train)))  # touch every pair
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(
    dist.get_rank(),
    len(train),
    train.ids.numel(),
    f"{t:.1f} s",
    before,
    mem(),
    f"peak {peak:.2f}",
    flush=True,
)
dist.destroy_process_group()
