"""Process group and FSDP2 sharding for Hugging Face causal LMs, one code path for 1..N ranks.

Copyable on its own: imports only the standard library and torch. This runs as written:

    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from fsdp_setup import (
        FSDPConfig,
        build_sharded,
        clip_grad_norm_,
        full_tensors,
        inference,
        init_distributed,
        mix_into,
        on_rank0,
    )
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # torchrun's environment, or (here) a world of one; nccl + gloo on CUDA, gloo on a CPU
    rank, world, device = init_distributed("cpu")


    class Tiny(nn.Module):  # a causal LM's parts: embeddings, blocks in a ModuleList, a head
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
            self.head = nn.Linear(8, 16)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = h + layer(h)
            return self.head(h)


    def make_model():  # parameters on the meta device
        with torch.device("meta"):
            return Tiny()


    # Full CPU tensors by name (memory-mapped files, in training): each rank reads its own rows.
    weights = {name: torch.randn(t.shape) for name, t in make_model().state_dict().items()}
    fp32 = MixedPrecisionPolicy()  # precision.py's, in training
    # Each block sharded, then the root; FSDPConfig: checkpointing, compile, offload, HSDP.
    model = build_sharded(make_model, weights, fp32, device, FSDPConfig())
    ids = torch.tensor([1, 2, 3, 4], device="cpu")
    model(ids).logsumexp(-1).mean().backward()
    norm = clip_grad_norm_(model, max_norm=1.0)  # the global norm, over every rank's shards
    with inference(model):  # eval, no grad; then the previous mode back, resharded
        logits = model(ids)
    print(type(model.head.weight).__name__, tuple(logits.shape), norm)
    # TR-DPO: reference = 0.6 policy + 0.4 reference, shard by shard
    reference = build_sharded(make_model, weights, fp32, device, FSDPConfig(), frozen=True)
    mix_into(reference, model, alpha=0.6)
    # rank 0 runs it (a download, tokenizing): every rank gets its result, or its error
    folder = on_rank0(tempfile.mkdtemp)
    for name, _, fetch in full_tensors(model, device):  # one full tensor at a time
        torch.save(fetch(), os.path.join(folder, name + ".pt"))  # rank 0 writes, in training
    print(sorted(os.listdir(folder)))
    dist.destroy_process_group()
"""

import contextlib
import functools
import itertools
import json
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

# Numbers for keys in the store, each process group's and each on_rank0 call's: every rank starts
# its groups and calls on_rank0 in the same order, so the n-th number names the same keys on each.
_store_keys = itertools.count(1)
# Seconds a collective may wait at start-up: loading, tokenizing and compiling on some ranks.
START_TIMEOUT_S = 1800


@dataclass
class FSDPConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto is cuda when a GPU is visible (nccl for GPU tensors, gloo for CPU ones),
    else cpu (gloo)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (non-reentrant): less memory, more
    compute."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after forward, gather them again in backward (ZeRO-3);
    off: ZeRO-2."""
    compile: bool = False
    """torch.compile each transformer block (dynamic shapes: micro-batches vary in length); first
    steps compile."""
    unsharded_grad_accumulation: bool = False
    """Accumulate micro-batch gradients unsharded and reduce-scatter once per step: fewer
    collectives, but every rank holds a full gradient in the reduce dtype until the last
    micro-batch. Off: only gradient shards are kept."""
    cpu_offload: bool = False
    """The policy's shards, gradients and AdamW state in host memory, its optimizer step on the CPU:
    less GPU memory."""
    deterministic: bool = False
    """Deterministic algorithms only (and cuBLAS's fixed workspace), so that a resumed run repeats
    the uninterrupted one bit for bit on GPUs too: an op without a deterministic kernel then fails
    naming itself. Off, GPU runs repeat only to rounding (flash attention's backward on long rows
    sums in varying order)."""
    replicas: int = 1
    """HSDP: R copies of the model, each sharded over world/R consecutive ranks (e.g. one node), so
    only gradient shards cross copies (an all-reduce over the R copies). 1: every rank shards one
    copy (FSDP)."""

    collective_timeout: int = 120
    """Seconds a collective waits for the other ranks once the first step is done (until then,
    while models load, data tokenizes and kernels compile, 30 minutes): a rank that stops answering
    (a hung GPU, a stalled file system) ends the job this long after, in one line."""

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.collective_timeout < 1:
            raise ValueError(f"--collective-timeout must be >= 1 s, got {self.collective_timeout}")


def init_distributed(
    device: str = "auto",
    replicas: int = 1,
    timeout_s: int = START_TIMEOUT_S,
    deterministic: bool = False,
    fake_world: int = 0,
) -> tuple[int, int, torch.device]:
    """Start the process group on `device` (auto, cuda or cpu); returns (rank, world_size, device).
    Without torchrun (no RANK) this process is a world of one, so FSDP2 and every collective run
    through the same code. On CUDA: nccl for CUDA tensors, gloo for CPU ones (object collectives,
    barriers, DCP). replicas: checked to divide the world. deterministic: see FSDPConfig.
    fake_world: instead, this process alone as rank 0 of that many, whose collectives move nothing
    (to shard models as on that many GPUs for a memory plan, on fake tensors)."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {device!r} is not one of auto, cuda, cpu")
    world = fake_world or int(os.environ.get("WORLD_SIZE", 1))
    if world % replicas:
        raise ValueError(f"--replicas {replicas} does not divide the {world} ranks")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    device = torch.device("cuda", _local_gpu()) if cuda else torch.device("cpu")
    if cuda:
        # Before the first allocation: segments grow in place instead of fragmenting under varying
        # batch shapes.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(device)
        # The peak is this run's, also after an earlier one in this process.
        torch.cuda.reset_peak_memory_stats(device)
        # cuDNN attention (SDPA's pick on Hopper) plans on the host for each new padded length;
        # flash needs no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if deterministic:
        # Read by cuBLAS when CUDA starts: a fixed workspace makes its reductions repeatable.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(deterministic)
    if fake_world:
        # Registers torch's own "fake" backend, kept with its tests.
        from torch.testing._internal.distributed import fake_pg  # noqa: F401

        dist.init_process_group("fake", rank=0, world_size=fake_world, store=dist.HashStore())
        return 0, fake_world, device
    # Under torchrun: keys of its own in the store, not an earlier group's in this process (main()
    # may run again). Alone: a HashStore needs no free port, so two single-process runs on one
    # machine never collide.
    if "RANK" in os.environ:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    else:
        store, rank, world = dist.HashStore(), 0, 1
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"dpo/{next(_store_keys)}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if cuda else None,
    )
    return rank, world, device


def set_timeout(model: nn.Module, seconds: float) -> None:
    """From now on, a collective of the default group or of sharded `model`'s device mesh fails
    once it has waited `seconds` for another rank: gloo's waits and NCCL's watchdog alike. Start-up
    keeps init_distributed's long timeout; training sets a short one after its first step."""
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    for group in (None, *mesh.get_all_groups()):
        # No public API changes a group's timeout (torchtitan calls this one too).
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def on_rank0(fn, *args, share: bool = True, per_node: bool = False):
    """fn(*args) on rank 0 alone; its result (share=False: None elsewhere) or failure (a ValueError
    as one, any other as a RuntimeError) reaches every rank. The others wait on the store: a
    collective could time out in a long rank-0 job. per_node: on each node's first rank (LOCAL_RANK
    0, torchrun's consecutive ranks), for its node's ranks: work on a node's own disk."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(*args)
    leader = dist.get_rank() - int(os.environ.get("LOCAL_RANK", 0)) if per_node else 0
    key = f"dpo/on_rank0/{next(_store_keys)}/{leader}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == leader:
        try:
            result = fn(*args)
        # The other ranks must hear of any failure (Ctrl-C too), or they would wait on.
        except BaseException as e:
            store.set(
                key, pickle.dumps((None, str(e) or type(e).__name__, isinstance(e, ValueError)))
            )
            raise
        store.set(key, pickle.dumps((result if share else None, None, False)))
        return result
    # As long as the longest rank-0 phase (a download, tokenizing) may take.
    store.wait([key], timedelta(hours=24))
    result, error, value_error = pickle.loads(store.get(key))
    if error is not None:
        raise ValueError(error) if value_error else RuntimeError(f"rank 0 failed: {error}")
    return result


def _local_gpu() -> int:
    """This process's GPU: LOCAL_RANK, or 0 when a launcher (SLURM, Kubernetes) shows it one
    (CUDA_VISIBLE_DEVICES)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    visible = torch.cuda.device_count()
    if visible == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    if local_rank >= visible:
        raise ValueError(
            f"LOCAL_RANK {local_rank} but this process sees only {visible} GPUs: start at most "
            f"{visible} processes per node, or show each process its own GPU (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def find_block_class(model: nn.Module) -> type[nn.Module]:
    """The transformer block class: named in `_no_split_modules`, else the longest ModuleList of one
    class's layers."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len({type(x) for x in m}) == 1
    ]
    if lists:
        return type(max(lists, key=len)[0])
    raise ValueError(
        f"no transformer block class found in {type(model).__name__}: it has no _no_split_modules "
        "and no ModuleList of repeated layers to shard or checkpoint"
    )


def build_sharded(
    make_model,
    weights: dict[str, torch.Tensor] | None,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    config: FSDPConfig,
    frozen: bool = False,
) -> nn.Module:
    """make_model() (parameters on the meta device), each transformer block checkpointed
    (non-reentrant, unless frozen) and compiled as `config` asks, then sharded in place with FSDP2
    on `device`, then the root with the rest (ties kept); each rank's shards read from `weights`
    (None: left on the meta device, for a memory plan, and not compiled). frozen: a reference (no
    gradients, eval mode), always resharded. config.replicas=R > 1: HSDP, an (R, world/R) mesh.
    Never-changing weights (frozen, LoRA's base) get no float32 master."""
    if config.unsharded_grad_accumulation and mp_policy.reduce_dtype == torch.bfloat16:
        raise ValueError(
            "--unsharded-grad-accumulation sums micro-batch gradients in bf16: use --reduce-dtype "
            "fp32"
        )
    if config.cpu_offload and device.type == "cuda" and mp_policy.param_dtype == torch.float16:
        raise ValueError(
            "--cpu-offload: fp16's loss scaler is not checked on host gradients; use --precision "
            "bf16"
        )
    model = make_model()
    if frozen:
        model.requires_grad_(False).eval()
    for param in model.parameters():
        if mp_policy.param_dtype is not None and not param.requires_grad:
            param.data = param.data.to(mp_policy.param_dtype)
    block_class = find_block_class(model)
    offload = config.cpu_offload and not frozen
    shard = {
        # An explicit mesh: FSDP2's default takes CUDA when a GPU is visible, even for a CPU model.
        "mesh": (
            init_device_mesh(device.type, (dist.get_world_size(),))
            if config.replicas == 1
            else _hsdp_mesh(dist.group.WORLD, device.type, config.replicas)
        ),
        "mp_policy": mp_policy,
        # Offloaded: shards, gradients and optimizer state on the host, pinned for fast GPU copies.
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
        ),
    }
    for block in [m for m in model.modules() if isinstance(m, block_class)]:
        # Checkpointed before sharding, so that the recomputation re-gathers parameters through
        # FSDP's hooks.
        if config.activation_checkpointing and not frozen:
            checkpoint(block)
        # A memory plan's model (no weights) is traced eagerly: Dynamo, meeting a compiled block
        # under the plan's dispatch mode, would skip that block's code for good, the run's blocks'
        # too. After checkpointing, to compile the recomputation too; before FSDP, keeping its
        # hooks out of the graph.
        if config.compile and weights is not None:
            block.compile(dynamic=True)
        fully_shard(block, reshard_after_forward=config.reshard_after_forward or frozen, **shard)
    # A trained root stays gathered after forward (FSDP2's default), as backward needs it at once.
    fully_shard(model, reshard_after_forward=True if frozen else None, **shard)
    # No weights: a memory plan's model, left on the meta device for fake tensors to fill.
    if weights is not None:
        load_sharded(model, weights, device, offload)
    return model


@functools.lru_cache(maxsize=1)
def _hsdp_mesh(world: dist.ProcessGroup, device_type: str, replicas: int):
    """One mesh per process group (`world`, the cache's key with the rest), shared by the policy
    and the reference: each subgroup costs communicators."""
    return init_device_mesh(
        device_type,
        (replicas, dist.get_world_size() // replicas),
        mesh_dim_names=("replicate", "shard"),
    )


@contextlib.contextmanager
def inference(model: nn.Module):
    """Eval mode and no autograd for forward-only passes; then the previous mode back and the root
    resharded, which FSDP2 keeps gathered after forward for a backward, while the optimizer and
    checkpoints need shards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)
        model.reshard()


@torch.no_grad()
def load_sharded(
    model: nn.Module, weights: dict[str, torch.Tensor], device: torch.device, offload: bool = False
):
    """Materialise a sharded meta-device model on `device` (offload: its shards on the host), each
    rank copying only its own rows of each parameter from `weights` (full CPU tensors by name, e.g.
    memory-mapped files, any dtype): no rank holds the whole model. Buffers keep the values the
    model was built with (computed, not saved)."""
    built = [(module, dict(module._buffers)) for module in model.modules()]
    model.to_empty(device="cpu" if offload else device)
    # Offloaded, the buffers still go where forward runs.
    for module, buffers in built:
        module._buffers.update({k: b.to(device) for k, b in buffers.items() if b is not None})
    persistent = model.state_dict().keys()
    # A persistent buffer the files hold (a trained bias) takes their value.
    for name, buf in model.named_buffers():
        if name in weights and name in persistent:
            buf.copy_(weights[name][:])
    # A tied weight comes once, under its first name.
    for name, param in model.named_parameters():
        full = weights.get(name)
        if full is None or full.shape != param.shape:
            found = "missing" if full is None else f"of shape {list(full.shape)}"
            raise ValueError(
                f"--model: its weight {name} of shape {list(param.shape)} is {found} in its files"
            )
        local = param.to_local() if isinstance(param, DTensor) else param
        # A rank that holds no rows of this weight (more ranks than experts) reads nothing.
        if local.numel():
            local.copy_(full[_local_rows(param)])


def _local_rows(param: torch.Tensor) -> slice:
    """The rows of the full tensor this rank holds: FSDP2 shards dim 0 as torch.chunk does; all of
    them if unsharded."""
    shard = [
        dim
        for dim, placement in enumerate(getattr(param, "placements", ()))
        if placement.is_shard(0)
    ]
    if not shard:
        return slice(None)
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size(shard[0]))
    start = min(param.device_mesh.get_local_rank(shard[0]) * per_rank, rows)
    return slice(start, min(start + per_rank, rows))


def full_tensors(
    model: nn.Module, device: torch.device
) -> list[tuple[str, torch.Tensor, Callable]]:
    """Each state-dict tensor of `model` once (a tied weight under its first name) as (name, tensor,
    fetch): fetch() gathers the full tensor on `device`, one at a time, on every rank (a collective:
    all ranks fetch, in order)."""
    # By identity: a tied weight's later names find its first.
    first = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), (name, tensor))
    return [
        (name, tensor, functools.partial(_full_tensor, tensor, device))
        for name, tensor in first.values()
    ]


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients of `model` (sharded or not) to a global norm of at most max_norm (0: no
    clipping). Returns the global norm before clipping over every rank's shards, a () tensor on the
    device."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or torch.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@torch.no_grad()
def mix_into(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """target = alpha source + (1 - alpha) target, each rank on its own shards of two models sharded
    alike (build_sharded), in target's dtype (TR-DPO's reference sync; as TRL:
    target.mul_(1 - alpha).add_(source, alpha=alpha))."""
    for (name, mine), (other, theirs) in zip(
        target.named_parameters(), source.named_parameters(), strict=True
    ):
        if name != other:
            raise ValueError(
                f"mix_into: {name} meets {other}: the two models must have the same parameters"
            )
        local = mine.to_local()
        # An offloaded source's shards come from the host.
        local.mul_(1 - alpha).add_(theirs.to_local().to(local.device), alpha=alpha)


def _full_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor.detach().to(device)
    # Offloaded shards are gathered on the device, where nccl can.
    return DTensor.from_local(
        tensor.to_local().detach().to(device),
        tensor.device_mesh,
        tensor.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
    ).full_tensor()


def save_files(folder: str, tokenizer, extra: dict) -> None:
    """The tokenizer's files and each {file name: JSON-able} of `extra`, into `folder`: call on one
    rank."""
    tokenizer.save_pretrained(folder)
    for name, obj in extra.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)


def run_and_exit(main: Callable) -> None:
    """main(), then exit with the code it gives sys.exit (0 when it returns), by
    exit_without_shutdown."""
    try:
        main()
    except SystemExit as e:
        exit_without_shutdown(e.code)
    exit_without_shutdown(0)


def exit_without_shutdown(code: int | str | None) -> None:
    """Exit now with sys.exit's `code`, skipping interpreter shutdown, where a gloo thread still
    releasing a collective's tensors can abort (SIGABRT) a run that wrote everything. Files are
    closed and flushed by then."""
    if isinstance(code, str):  # sys.exit("message") prints it
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))
