"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own
shard.

Copyable on its own: imports only the standard library and torch.

A checkpoint folder holds the model (less frozen weights, such as LoRA's base) and optimizer shards
(DCP), trainer_state.json (the caller's extra plus world_size) and rng-rank{r}.pt (torch CPU, own
GPU, Python RNGs). This runs as written:

    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from checkpoint import Checkpointer, StopRequest, load_checkpoint, resume_state
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = tempfile.mkdtemp()


    def build():  # a sharded model and its AdamW, as training builds them
        model = fully_shard(nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)


    model, optimizer = build()
    config = {"seed": 0, "lr": 0.1}
    saver = Checkpointer(root, keep_last=2)  # background=True: writes in a thread
    stop = StopRequest()  # SIGTERM/SIGUSR1/SIGINT: finish the step, save, exit
    for step in (1, 2, 3):
        model(torch.ones(1, 4, device="cpu")).sum().backward()
        optimizer.step()
        # root/step-N, then root/latest pointing at it
        saver.save(step, model, optimizer, {"step": step, "config": config})
        if stop.signum:
            break
    saver.finish()  # waits for a background write and moves root/latest
    stop.restore()
    print(sorted(os.listdir(root)))  # the newest keep_last, and latest
    # --resume latest in a new run: find_checkpoint, read_trainer_state (cheap: before building
    # models) and check_same_run at once; the saved extra and its "path".
    state = resume_state(root, "latest", {"config": config}, fixed={"seed": "--seed"})
    resumed, resumed_optimizer = build()
    load_checkpoint(state["path"], resumed, resumed_optimizer)  # any world size: DCP reshards
    print(state["step"], torch.equal(resumed.weight.full_tensor(), model.weight.full_tensor()))
    try:
        resume_state(root, "latest", {"config": {"seed": 1}}, fixed={"seed": "--seed"})
    except ValueError as e:
        print(e)  # --resume: --seed is 1 but the checkpoint was trained with 0; ...
    dist.destroy_process_group()
"""

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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

_STATE = "trainer_state.json"


@dataclass
class CheckpointConfig:
    save_every: int = 0
    """Save a sharded checkpoint to {out_dir}/checkpoints/step-N every N steps; 0 disables."""
    keep_last: int = 0
    """Keep only the newest K checkpoints; 0 keeps all."""
    resume: str | None = None
    """Resume from a checkpoint folder, or "latest" for {out_dir}/checkpoints/latest. Default: a
    new run."""
    async_save: bool = False
    """Write checkpoints in a background thread: training waits only while the shards are copied to
    host memory (one more copy of them). `latest` moves once the write is complete; a stop, the end
    and the next save wait."""

    def __post_init__(self):
        if self.save_every < 0:
            raise ValueError(f"--save-every must be >= 0, got {self.save_every}")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 0, got {self.keep_last}")


class Checkpointer:
    """A run's checkpoints in `root`. save() writes root/step-N (as step-N.tmp, renamed once
    complete), then points root/latest at it, so that a run killed mid-save resumes from the
    previous one, and keeps the newest keep_last (0: all). With background=True, save() returns
    once the shards are copied to host memory, and a thread writes them; finish() completes that
    write. Either way a save's collectives run over a gloo group of its own, with a long timeout.
    Make one per process group, on every rank, once the models are on their device: it holds that
    group (made here, a collective) and, on GPUs, the pinned host buffers that every save
    reuses."""

    def __init__(
        self,
        root: str,
        keep_last: int = 0,
        background: bool = False,
        resume_hint: str = "continue with --resume latest",
    ):
        self.root = root
        self.keep_last = keep_last
        self.background = background
        # What a failed save's line ends with: how to resume once the disk has room.
        self.resume_hint = resume_hint
        # The background write in flight: (its future, the folder `latest` moves to once done).
        self._write = None
        # Its own timeout, not training's short one: the write's last gather waits for the slowest
        # rank's shards to reach the disk.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(hours=6))
        # Pinned host buffers on GPUs, made once and reused by every save: fast copies from the GPU,
        # and no new page-locked memory at each save.
        self._stager = (
            staging.DefaultStager(
                staging.StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
            if background and torch.cuda.is_initialized()
            else None
        )

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict,
        reference: nn.Module | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> str:
        """Collective: root/step-{step} with the model and optimizer shards, this rank's RNG states
        and trainer_state.json (`extra`, the world size, and the state of an enabled fp16 loss
        `scaler`); returns its path. reference: a frozen model that changes in training (TR-DPO's),
        saved whole beside the model."""
        # At most one write in flight: its staged copy is the memory a background save costs.
        self.finish()
        path = os.path.join(self.root, f"step-{step}")
        tmp = path + ".tmp"
        try:
            if dist.get_rank() == 0:
                # Leftovers of an earlier save that was killed go first.
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                state = {**extra, "world_size": dist.get_world_size()}
                if scaler is not None:
                    state["scaler"] = scaler.state_dict() if scaler.is_enabled() else None
                pathlib.Path(tmp, _STATE).write_text(json.dumps(state, indent=2))
            dist.barrier(group=self._group)
            # A shared file system may show another node rank 0's new folder late.
            os.makedirs(tmp, exist_ok=True)
            torch.save(
                {
                    "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                    # The current GPU's generator (the parameters may be offloaded); a CPU run,
                    # which never starts CUDA, does not start it here.
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
                },
                os.path.join(tmp, f"rng-rank{dist.get_rank()}.pt"),
            )
            trained = _trained_state(model, optimizer, reference)
            # Either write ends in a gather: rank 0's is done once every rank's shards and RNG file
            # are on disk, before `latest` moves.
            if self.background:
                self._write = (
                    dcp.async_save(
                        trained,
                        checkpoint_id=tmp,
                        process_group=self._group,
                        async_stager=self._stager,
                    ),
                    path,
                )
            else:
                dcp.save(trained, checkpoint_id=tmp, process_group=self._group)
                self._publish(path)
                # No rank goes on before `latest` has moved.
                dist.barrier(group=self._group)
        except (OSError, RuntimeError, CheckpointException) as e:
            raise self._failed(path, e) from None
        return path

    def finish(self, wait: bool = True) -> None:
        """Complete a background save: wait for its write (wait=False: only if it is done already)
        and let rank 0 move `latest` to it. A failed write raises here. No collective: safe to call
        on any one rank."""
        if self._write is None or not (wait or self._write[0].done()):
            return
        future, path = self._write
        self._write = None
        try:
            future.result()
            self._publish(path)
        except (OSError, RuntimeError, CheckpointException) as e:
            raise self._failed(path, e) from None

    def _failed(self, path: str, error: BaseException) -> ValueError:
        """The one line a failed save (a full disk) ends the run with, once this rank's part of
        its folder is gone: the folder, why, the last complete checkpoint and how to resume."""
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        return ValueError(
            f"{path}: not saved ({_reason(error)}); its partial folder is removed. The last "
            f"complete checkpoint: {_previous(path) or 'none'}; once the disk has room, "
            f"{self.resume_hint}"
        )

    def _publish(self, path: str) -> None:
        """Rank 0 renames step-N.tmp to step-N, points `latest` at it, and prunes to keep_last."""
        if dist.get_rank() != 0:
            return
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
        latest = os.path.join(self.root, "latest")
        pathlib.Path(latest + ".tmp").write_text(os.path.basename(path))
        # A rename: a reader never sees half a pointer.
        os.replace(latest + ".tmp", latest)
        if self.keep_last:
            done = sorted(
                (n for n in os.listdir(self.root) if re.fullmatch(r"step-\d+", n)),
                key=lambda n: int(n.split("-")[1]),
            )
            for old in done[: -self.keep_last]:
                shutil.rmtree(os.path.join(self.root, old))


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


def resume_state(root: str, spec: str | None, current: dict, fixed: dict[str, str]) -> dict | None:
    """--resume `spec` (see find_checkpoint): the checkpoint's trainer state with its "path", once
    check_same_run finds `current` (JSON-able, compared as it would be saved) the same run in
    every `fixed` setting. None (no --resume): a new run, None, refused where `root` holds another
    run's checkpoints, which it would mix with its own. Either way refused where the nearest folder
    above `root` that exists is a file or one this process cannot write in, before any work."""
    existing = next(p for p in pathlib.Path(os.path.abspath(root)).parents if p.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK)):
        raise ValueError(f"{os.path.dirname(root)}: a run cannot make its folder in {existing}")
    if spec is None and os.path.isfile(os.path.join(root, "latest")):
        raise ValueError(
            f"{root} holds a run's checkpoints: continue that run with --resume latest, or give "
            "this one another --out-dir"
        )
    if spec is None:
        return None
    path = find_checkpoint(root, spec)
    saved = {**read_trainer_state(path), "path": path}
    check_same_run(saved, json.loads(json.dumps(current)), fixed)
    return saved


def read_trainer_state(path: str) -> dict:
    """The extra dict saved with the checkpoint, plus "world_size"."""
    return json.loads(pathlib.Path(path, _STATE).read_text())


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> bool:
    """Load `path` into the sharded model and optimizer (and reference, and an fp16 loss scaler's
    state, as saved), and this rank's RNGs unless the world size changed (False)."""
    state = _trained_state(model, optimizer, reference)
    saved = read_trainer_state(path)
    same_world = saved["world_size"] == dist.get_world_size()
    try:
        # Fails naming any key of `state` that the checkpoint lacks.
        dcp.load(state, checkpoint_id=path)
        rng_file = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
        rng = torch.load(rng_file, weights_only=True) if same_world else None
    except (Exception, CheckpointException) as e:
        # A file cut short or missing: whatever the reader raised, said in one line.
        previous = _previous(path)
        fallback = f"--resume {previous}" if previous else "none is older"
        raise ValueError(
            f"--resume {path}: damaged checkpoint ({_reason(e)}); the previous complete one: "
            f"{fallback}"
        ) from None
    # Not strict: frozen weights are not in the checkpoint, the model has them already.
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )
    if reference is not None:
        set_model_state_dict(reference, state["reference"])
    # A disabled scaler (not fp16) ignores a saved state.
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if not same_world:
        return False
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    # This GPU's generator. None when saved by a CPU run; a list (every GPU's states) is not this
    # GPU's own, so it is not restored.
    if isinstance(rng["cuda"], torch.Tensor) and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(rng["cuda"])
    return True


def _reason(error: BaseException) -> str:
    """An error's type and first line; of DCP's, which gathers every rank's, the first rank's."""
    if isinstance(error, CheckpointException):
        rank, (first, _) = next(iter(error.failures.items()))
        return f"rank {rank}: {_reason(first)}"
    line = str(error).strip().partition("\n")[0]
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _previous(path: str) -> str | None:
    """The newest complete checkpoint (one with its trainer state) beside `path` and older than
    it: a step-N folder of a smaller N; None where there is none."""
    root, name = os.path.split(os.path.normpath(path))
    step = int(name[5:]) if re.fullmatch(r"step-\d+", name) else float("inf")
    older = [
        int(n[5:])
        for n in os.listdir(root)
        if re.fullmatch(r"step-\d+", n)
        and int(n[5:]) < step
        and os.path.isfile(os.path.join(root, n, _STATE))
    ]
    return os.path.join(root, f"step-{max(older)}") if older else None


def _trained_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, reference: nn.Module | None
) -> dict:
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
    e.g. "--seed"}. A setting the checkpoint does not record (newer than it) is not compared."""
    flat_saved = _leaves(saved)
    flat_current = _leaves(current)
    for key, label in fixed.items():
        if key in flat_saved and flat_saved[key] != flat_current.get(key):
            raise ValueError(
                f"--resume: {label} is {_short(flat_current.get(key))} but the checkpoint was "
                f"trained with {_short(flat_saved.get(key))}; these must match to resume: "
                f"{', '.join(fixed.values())}"
            )


def _short(value) -> str:
    # A hash: its start is enough to tell two apart.
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 40 else repr(value)


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
