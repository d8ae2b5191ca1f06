"""Run a Python script and print its peak host memory (max RSS, the kernel's count for the child
process) once it ends: measured from outside the process, export and shutdown included, one line per
torchrun rank.

    torchrun --standalone --nproc_per_node=2 bench/peak_rss.py train_dpo.py \
        --model runs/bench/llama-270m ...
"""

import os
import resource
import subprocess
import sys

code = subprocess.call([sys.executable, *sys.argv[1:]])
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
print(
    f"rank {os.environ.get('RANK', '0')}: peak host memory {peak:.2f} GB, exit {code}",
    file=sys.stderr,
)
sys.exit(code)
