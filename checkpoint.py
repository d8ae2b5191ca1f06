"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shard.

Copyable on its own: imports only the standard library and torch.

    save_checkpoint(root, step, model, optimizer, {"step": step, ...})   # root/step-N, root/latest
    path = find_checkpoint(root, "latest")                                 # or an explicit step-N path
    extra = load_checkpoint(path, model, optimizer)
"""

import json
import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

_EXTRA = "trainer_state.json"


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: Optimizer, extra: dict) -> str:
    """Write model and optimizer shards plus `extra` (JSON) to root/step-{step}; point root/latest at it.

    The shards go to a temporary folder that is renamed only once complete, and `latest` moves last, so
    a run killed mid-save still resumes from the previous checkpoint. Collective: call on every rank.
    """
    path = os.path.join(root, f"step-{step}")
    tmp = path + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an earlier killed save
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if rank == 0:
        with open(os.path.join(tmp, _EXTRA), "w") as f:
            json.dump(extra, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(path))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    dist.barrier()
    return path


def find_checkpoint(root: str, spec: str) -> str:
    """Resolve --resume: "latest" reads root/latest; anything else is a checkpoint folder path."""
    if spec == "latest":
        pointer = os.path.join(root, "latest")
        if not os.path.isfile(pointer):
            raise ValueError(f"--resume latest: {pointer} does not exist (no checkpoint saved yet)")
        with open(pointer) as f:
            spec = os.path.join(root, f.read().strip())
    if not os.path.isfile(os.path.join(spec, _EXTRA)):
        raise ValueError(f"--resume {spec}: not a checkpoint folder (no {_EXTRA})")
    return spec


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizer) -> dict:
    """Load shards from `path` into the (already sharded) model and optimizer; return the saved extra."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, _EXTRA)) as f:
        return json.load(f)
