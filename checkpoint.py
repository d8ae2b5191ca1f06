"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own
shard.

Copyable on its own: imports only the standard library and torch.

    # root/step-N, then root/latest pointing at it
    save_checkpoint(root, step, model, optimizer, {"step": step, ...}, keep_last=3)
    # returns once staged; finish_checkpoint() completes it
    save_checkpoint(..., background=True)
    path = find_checkpoint(root, "latest")  # or an explicit step-N folder
    state = read_trainer_state(path)  # the saved extra, cheap: before building models
    check_same_run(state, {"config": config}, fixed={"model": "--model", "seed": "--seed"})
    load_checkpoint(path, model, optimizer)  # any world size: DCP reshards on load
    stop = StopRequest()  # SIGTERM/SIGUSR1/SIGINT: finish the step, save, exit

A checkpoint folder holds the model (less frozen weights, such as LoRA's base) and optimizer shards
(DCP), trainer_state.json (the caller's extra plus world_size) and rng-rank{r}.pt (torch CPU, own
GPU, Python RNGs).
"""

import functools
import json
import os
import pathlib
import random
import re
import shutil
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

_STATE = "trainer_state.json"
# "write": (future, publish) of a background save; "group": its gloo group, made for "world";
# "stager"
_pending = {}


@dataclass
class CheckpointConfig:
    save_every: int = 0
    """Save a sharded checkpoint to {out_dir}/checkpoints/step-N every N steps; 0 disables."""
    keep_last: int = 0
    """Keep only the newest K checkpoints; 0 keeps all."""
    resume: str | None = None
    """Resume from a checkpoint folder, or "latest" for {out_dir}/checkpoints/latest."""
    async_save: bool = False
    """Write checkpoints in a background thread: training waits only while the shards are copied to
    host memory (one more copy of them). `latest` moves once the write is complete; a stop, the end
    and the next save wait."""

    def __post_init__(self):
        if self.save_every < 0:
            raise ValueError(f"--save-every must be >= 0, got {self.save_every}")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 0, got {self.keep_last}")


def save_checkpoint(
    root: str,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    extra: dict,
    keep_last: int = 0,
    background: bool = False,
    reference: nn.Module | None = None,
) -> str:
    """Collective: write root/step-{step} (as step-N.tmp, renamed once complete), then point
    root/latest at it, so a run killed mid-save resumes from the previous one; keep the newest
    keep_last (0: all). background=True returns once the shards are staged in host memory: a thread
    writes them over its own gloo group; finish_checkpoint completes it. reference: a frozen model
    that changes in training (TR-DPO's), saved whole beside the model."""
    # at most one write in flight: its staged copy is the memory async saving costs
    finish_checkpoint()
    path = os.path.join(root, f"step-{step}")
    tmp = path + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an earlier killed save
        os.makedirs(tmp)
        pathlib.Path(tmp, _STATE).write_text(
            json.dumps({**extra, "world_size": dist.get_world_size()}, indent=2)
        )
    dist.barrier()
    os.makedirs(
        tmp, exist_ok=True
    )  # a shared file system may show another node rank 0's new folder late
    # The current GPU's (parameters may be offloaded); a CPU run, which never starts CUDA, does not
    # start it here.
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }
    torch.save(rng, os.path.join(tmp, f"rng-rank{rank}.pt"))
    state = _trained_state(model, optimizer, reference)
    if background:
        if (
            _pending.get("world") is not dist.group.WORLD
        ):  # once per process group, on every rank (a collective)
            # Its own timeout: the write's last gather waits for the slowest rank's shards to reach
            # the disk.
            _pending.update(
                world=dist.group.WORLD,
                group=dist.new_group(backend="gloo", timeout=timedelta(hours=6)),
            )
        # The write ends in a gather: rank 0's future is done once every rank's shards and RNG file
        # are on disk.
        if (
            torch.cuda.is_initialized() and "stager" not in _pending
        ):  # pinned host buffers, reused by every save
            _pending["stager"] = staging.DefaultStager(
                staging.StagingOptions(True, False, False, False)
            )  # pinned
        _pending["write"] = (
            dcp.async_save(
                state,
                checkpoint_id=tmp,
                process_group=_pending["group"],
                async_stager=_pending.get("stager"),
            ),
            functools.partial(_publish, root, path, keep_last),
        )
        return path
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every rank's part is on disk
    _publish(root, path, keep_last)
    dist.barrier()
    return path


def finish_checkpoint(wait: bool = True) -> None:
    """Complete a background save_checkpoint: wait for its write (wait=False: only if already done)
    and let rank 0 move `latest` to it. A failed write raises here. No collective: safe to call on
    any one rank."""
    if "write" not in _pending or not (wait or _pending["write"][0].done()):
        return
    future, publish = _pending.pop("write")
    future.result()
    publish()


def _publish(root: str, path: str, keep_last: int) -> None:
    if dist.get_rank() != 0:
        return
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)
    latest = os.path.join(root, "latest")
    pathlib.Path(latest + ".tmp").write_text(os.path.basename(path))
    os.replace(latest + ".tmp", latest)  # a reader never sees half a pointer
    if keep_last:
        done = [n for n in os.listdir(root) if re.fullmatch(r"step-\d+", n)]
        for old in sorted(done, key=lambda n: int(n.split("-")[1]))[:-keep_last]:
            shutil.rmtree(os.path.join(root, old))


def find_checkpoint(root: str, spec: str) -> str:
    """Resolve --resume: "latest" reads root/latest; anything else is a checkpoint folder path."""
    if spec == "latest":
        pointer = os.path.join(root, "latest")
        if not os.path.isfile(pointer):
            raise ValueError(f"--resume latest: {pointer} does not exist (no checkpoint saved yet)")
        spec = os.path.join(root, pathlib.Path(pointer).read_text().strip())
    if not os.path.isfile(os.path.join(spec, _STATE)):
        raise ValueError(f"--resume {spec}: not a complete checkpoint folder (no {_STATE})")
    return spec


def read_trainer_state(path: str) -> dict:
    """The extra dict saved with the checkpoint, plus "world_size"."""
    return json.loads(pathlib.Path(path, _STATE).read_text())


def load_checkpoint(
    path: str, model: nn.Module, optimizer: Optimizer, reference: nn.Module | None = None
) -> bool:
    """Load `path` into the sharded model and optimizer (and reference, as saved), and this rank's
    RNGs unless the world size changed (False)."""
    state = _trained_state(model, optimizer, reference)
    dcp.load(state, checkpoint_id=path)  # fails naming any key of `state` the checkpoint lacks
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )  # frozen weights are the model's own, not loaded
    if reference is not None:
        set_model_state_dict(reference, state["reference"])
    if read_trainer_state(path)["world_size"] != dist.get_world_size():
        return False
    rng = torch.load(os.path.join(path, f"rng-rank{dist.get_rank()}.pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if (
        isinstance(rng["cuda"], torch.Tensor) and torch.cuda.is_initialized()
    ):  # older checkpoints: a list
        torch.cuda.set_rng_state(rng["cuda"])  # the current GPU's
    return True


def _trained_state(model: nn.Module, optimizer: Optimizer, reference: nn.Module | None) -> dict:
    """The model's state less frozen weights (LoRA's base: a resumed run has them already), the
    optimizer's, and the reference's when given."""
    frozen = {
        name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=True)
    )
    state = {
        "model": {k: v for k, v in model_state.items() if k not in frozen},
        "optim": optim_state,
    }
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    return state


def check_same_run(saved: dict, current: dict, fixed: dict[str, str]) -> None:
    """Refuse to resume when a setting differs; `fixed`: {leaf name in the nested dicts: its flag,
    e.g. "--seed"}."""
    flat_saved, flat_current = _leaves(saved), _leaves(current)
    for key, label in fixed.items():
        if flat_saved.get(key) != flat_current.get(key):
            raise ValueError(
                f"--resume: {label} is {_short(flat_current.get(key))} but the checkpoint was "
                f"trained with {_short(flat_saved.get(key))}; these must match to resume: "
                f"{', '.join(fixed.values())}"
            )


def _short(value) -> str:
    if isinstance(value, str) and len(value) > 40:  # a hash: its start is enough to tell two apart
        return f"{value[:12]}..."
    return repr(value)


def _leaves(config: dict) -> dict:
    out = {}
    for key, value in config.items():
        out.update(_leaves(value) if isinstance(value, dict) else {key: value})
    return out


class StopRequest:
    """Turn SIGTERM, SIGUSR1 (SLURM's --signal warning) and SIGINT into a flag the training loop
    checks after each step; a second signal acts as usual (Ctrl-C twice quits at once). `signum`:
    the signal received, 0 if none."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._previous[signum])

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process it ended; SIGTERM's when another rank got
        the signal."""
        return 128 + (self.signum or signal.SIGTERM)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
