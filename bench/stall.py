"""A rank that stops answering, as a hung GPU or a stalled file system would: train_dpo.py whose
rank 1 stops itself (SIGSTOP) at its second step, after writing the time into --out-dir/stalled.
From the repo root, the seconds from the stall to the job's end under torchrun:

    python bench/make_model.py runs/bench/llama-60m 60m  # once
    rm -rf runs/bench/stall && mkdir -p runs/bench/stall && start=$(date +%s.%N) && \
        torchrun --standalone --nproc_per_node=2 bench/stall.py --model runs/bench/llama-60m \
        --max-steps 4 --batch-size 8 --num-samples 0 --no-warm-start --collective-timeout 10 \
        --out-dir runs/bench/stall > runs/bench/stall.log 2>&1; \
        echo "$(date +%s.%N) - $(cat runs/bench/stall/stalled)" | bc
"""

import os
import signal
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.getcwd())
import fsdp_setup  # noqa: E402
import train_dpo  # noqa: E402

real = train_dpo.train_step
calls = []


def train_step(*args):
    calls.append(1)
    if len(calls) == 2 and dist.get_rank() == 1:
        out = sys.argv[sys.argv.index("--out-dir") + 1]
        with open(os.path.join(out, "stalled"), "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(*args)


train_dpo.train_step = train_step
fsdp_setup.run_and_exit(train_dpo.main)
