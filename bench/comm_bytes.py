"""Bytes that FSDP2's collectives move in one training step, counted on the calls themselves,
against the model in BENCHMARKS.md ("Past one node"). Run under torchrun with train_dpo.py's flags,
e.g. from the repo root:
    torchrun --standalone --nproc_per_node=4 bench/comm_bytes.py \
        --max-steps 2 --replicas 2 --device cpu
Prints, from rank 0, one JSON line: per step and rank, the bytes of each collective (all-gather: the
gathered output; reduce-scatter: the input; all-reduce across replicas: the tensor) counted and
predicted."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_dpo  # noqa: E402
import fsdp_setup  # noqa: E402
from fsdp_setup import find_block_class  # noqa: E402

counted, inside = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}, [False]


def counting(name, fn, which):
    def wrapper(*args, **kwargs):
        if inside[0]:
            counted[name] += (t := which(*args, **kwargs)).numel() * t.element_size()
        return fn(*args, **kwargs)

    return wrapper


dist.all_gather_single = counting("all_gather", dist.all_gather_single, lambda out, *a, **k: out)
dist.reduce_scatter_single = counting(
    "reduce_scatter",
    dist.reduce_scatter_single,
    lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None),
)
real_all_reduce = dist.all_reduce
# FSDP's all-reduce across replicas (HSDP) runs on the replicate group; the trainer's own metrics on
# the world.
dist.all_reduce = counting(
    "all_reduce",
    real_all_reduce,
    lambda t, *a, **k: (
        t
        if k.get("group") is not None and dist.get_world_size(k["group"]) < dist.get_world_size()
        else t[:0]
    ),
)
real_step = train_dpo.train_step
real_setup = train_dpo.setup
steps, seen = [], {}


def train_step(*args, **kwargs):
    """One training step, whose collectives are counted."""
    inside[0] = True
    stats = real_step(*args, **kwargs)
    inside[0] = False
    steps.append(dict(counted))
    counted.update(dict.fromkeys(counted, 0))
    return stats


def setup(*args, **kwargs):  # the run, and the process group's shape while it exists
    run, optimizer = real_setup(*args, **kwargs)
    seen.update(run=run, world=dist.get_world_size(), rank=dist.get_rank())
    return run, optimizer


train_dpo.train_step = train_step
train_dpo.setup = setup
try:
    train_dpo.main(sys.argv[1:])
except SystemExit as e:
    if e.code:
        raise
run, world = seen["run"], seen["world"]


def size(model, dtype_of):
    """Bytes of the (full) parameters in a block and outside the blocks, as FSDP gathers them."""
    blocks = {
        id(p) for m in model.modules() if type(m) is find_block_class(model) for p in m.parameters()
    }
    total = {True: 0, False: 0}
    for p in model.parameters():
        total[id(p) in blocks] += p.numel() * dtype_of(p).itemsize
    return total[True], total[False]


mp = run.precision.mp_policy


def param(p):
    return mp.param_dtype or p.dtype


def stored(p):
    return p.dtype


micro = run.cfg.batching.batch_size // (run.cfg.batching.micro_batch_size * world)
blocks, root = size(run.policy, param)
gather = micro * (
    2 * blocks + root
)  # blocks: forward and backward; the trained root stays gathered in between
if run.reference is not None:
    gather += micro * sum(size(run.reference, stored))  # stored in the compute dtype already
grads = (
    sum(p.numel() for p in run.policy.parameters()) * (mp.reduce_dtype or torch.float32).itemsize
)
replicas = run.cfg.fsdp.replicas
predicted = {
    "all_gather": gather,
    "reduce_scatter": micro * grads,
    "all_reduce": micro * grads // (world // replicas) if replicas > 1 else 0,
}
if seen["rank"] == 0:
    print(
        json.dumps(
            {
                "world": world,
                "replicas": replicas,
                "micro_batches": micro,
                "counted": steps[-1],
                "predicted": predicted,
            }
        )
    )
fsdp_setup.exit_without_shutdown(0)
