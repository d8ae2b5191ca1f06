"""Process group and FSDP2 sharding for Hugging Face causal LMs, one code path for 1..N ranks.

Copyable on its own: imports only the standard library and torch.

    rank, world, device = init_distributed()        # torchrun's env, or a world of one; nccl + gloo on CUDA
    model = build_sharded(make_model, full_model_or_None, mp_policy, device, FSDPConfig())
    with inference(model): model(**batch)           # eval, no grad; then the previous mode back, resharded
    path = on_rank0(build_cache)                     # rank 0 works, every rank gets its result (or error)
    state = gather_full_state_dict(model)            # full weights on rank 0 (ties kept), {} elsewhere
    save_pretrained(model, "final", torch.bfloat16, tokenizer)   # a Hugging Face folder, written by rank 0
"""

import contextlib
import itertools
import json
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

_groups = itertools.count(1)  # process groups started in this process
_rank0_calls = itertools.count(1)  # every rank calls on_rank0 in the same order: the n-th call's key
_RANK0_WAIT = timedelta(hours=24)  # the longest rank-0 phase the other ranks wait for
_meshes = {}  # the HSDP mesh of the current process group


@dataclass
class FSDPConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto is cuda when a GPU is visible (nccl for GPU tensors, gloo for CPU ones), else cpu (gloo)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (non-reentrant): less memory, more compute."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after forward, gather them again in backward (ZeRO-3); off: ZeRO-2."""
    compile: bool = False
    """torch.compile each transformer block (dynamic shapes: micro-batches vary in length); first steps compile."""
    unsharded_grad_accumulation: bool = False
    """Accumulate micro-batch gradients unsharded and reduce-scatter once per step: fewer collectives, but every
    rank holds a full gradient in the reduce dtype until the last micro-batch. Off: only gradient shards are kept."""
    cpu_offload: bool = False
    """The policy's shards, gradients and AdamW state in host memory, its optimizer step on the CPU: less GPU memory."""
    replicas: int = 1
    """HSDP: R copies of the model, each sharded over world/R consecutive ranks (e.g. one node), so only gradient
    shards cross copies (an all-reduce over the R copies). 1: every rank shards one copy (FSDP)."""

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")


def init_distributed(device: str = "auto", replicas: int = 1, timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Start the process group on `device` (auto, cuda or cpu); returns (rank, world_size, device). Without torchrun
    (no RANK) this process is a world of one, so FSDP2 and every collective run through the same code. On CUDA: nccl
    for CUDA tensors, gloo for CPU ones (object collectives, barriers, DCP). replicas: checked to divide the world."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {device!r} is not one of auto, cuda, cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % replicas:
        raise ValueError(f"--replicas {replicas} does not divide the {world} ranks")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    device = torch.device("cuda", _local_gpu()) if cuda else torch.device("cpu")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        # Before the first allocation: segments grow in place instead of fragmenting under varying batch shapes.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)  # the peak is this run's, also after an earlier one in this process
        # cuDNN attention (SDPA's pick on Hopper) plans on the host for each new padded length; flash needs no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    device_id = device if cuda else None
    if "RANK" in os.environ:  # keys of its own, not an earlier group's in this process: main() may run again
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        dist.init_process_group(backend, store=dist.PrefixStore(f"dpo/{next(_groups)}", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    else:  # a HashStore needs no free port, so two single-process runs on one machine never collide
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return dist.get_rank(), dist.get_world_size(), device


def on_rank0(fn, share: bool = True):
    """fn() on rank 0 alone; its result (share=False: None elsewhere) or failure (a ValueError as one, any other as a
    RuntimeError) reaches every rank. The others wait on the store: a collective could time out in a long rank-0 job."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    key = f"dpo/on_rank0/{next(_rank0_calls)}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        try:
            result = fn()
        except BaseException as e:  # the other ranks must hear of any failure (Ctrl-C too), or they wait on
            store.set(key, pickle.dumps((None, str(e) or type(e).__name__, isinstance(e, ValueError))))
            raise
        store.set(key, pickle.dumps((result if share else None, None, False)))
        return result
    store.wait([key], _RANK0_WAIT)
    result, error, value_error = pickle.loads(store.get(key))
    if error is not None:
        raise ValueError(error) if value_error else RuntimeError(f"rank 0 failed: {error}")
    return result


def _local_gpu() -> int:
    """This process's GPU: LOCAL_RANK, or 0 when a launcher (SLURM, Kubernetes) shows it one (CUDA_VISIBLE_DEVICES)."""
    local_rank, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if visible == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    if local_rank >= visible:
        raise ValueError(f"LOCAL_RANK {local_rank} but this process sees only {visible} GPUs: start at most "
                         f"{visible} processes per node, or show each process its own GPU (CUDA_VISIBLE_DEVICES)")
    return local_rank


def find_block_class(model: nn.Module) -> type[nn.Module]:
    """The transformer block class: named in `_no_split_modules`, else the longest ModuleList of one class's layers."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len({type(x) for x in m}) == 1]
    if lists:
        return type(max(lists, key=len)[0])
    raise ValueError(f"no transformer block class found in {type(model).__name__}: it has no _no_split_modules "
                     "and no ModuleList of repeated layers to shard or checkpoint")


def _blocks(model: nn.Module) -> list[nn.Module]:
    block_class = find_block_class(model)
    return [m for m in model.modules() if isinstance(m, block_class)]


def apply_ac(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on each transformer block, in place (names and state-dict keys
    unchanged). Apply before apply_fsdp, so the recomputation re-gathers parameters through FSDP's hooks."""
    for block in _blocks(model):
        checkpoint(block)


def build_sharded(make_model, full_model: nn.Module | None, mp_policy: MixedPrecisionPolicy, device: torch.device,
                  config: FSDPConfig, frozen: bool = False) -> nn.Module:
    """make_model() on meta, checkpointed (unless frozen: a reference) and compiled as `config` asks, sharded, filled
    from rank 0's `full_model` (None elsewhere). Never-changing weights (frozen, LoRA's base) get no float32 master."""
    if config.unsharded_grad_accumulation and mp_policy.reduce_dtype == torch.bfloat16:
        raise ValueError("--unsharded-grad-accumulation sums micro-batch gradients in bf16: use --reduce-dtype fp32")
    if config.cpu_offload and device.type == "cuda" and mp_policy.param_dtype == torch.float16:
        raise ValueError("--cpu-offload: fp16's loss scaler is not checked on host gradients; use --precision bf16")
    with torch.device("meta"):
        model = make_model()
    if mp_policy.param_dtype is not None:
        for param in model.parameters():
            if frozen or not param.requires_grad:
                param.data = param.data.to(mp_policy.param_dtype)
    if config.activation_checkpointing and not frozen:
        apply_ac(model)
    if config.compile:
        # After checkpointing, to compile the recomputation too; before FSDP, keeping its hooks out of the graph.
        for block in _blocks(model):
            block.compile(dynamic=True)
    apply_fsdp(model, mp_policy, device, frozen=frozen, reshard_after_forward=config.reshard_after_forward,
               replicas=config.replicas, offload=config.cpu_offload and not frozen)
    load_from_rank0(model, full_model, device, config.cpu_offload and not frozen)
    return model


def apply_fsdp(model: nn.Module, mp_policy: MixedPrecisionPolicy, device: torch.device, frozen: bool = False,
               reshard_after_forward: bool = True, replicas: int = 1, offload: bool = False) -> nn.Module:
    """Shard `model` in place with FSDP2 on `device`: each transformer block, then the root with the rest (ties kept).
    frozen: a reference (no gradients, eval mode), always resharded. replicas=R > 1: HSDP, an (R, world/R) mesh."""
    world = dist.get_world_size()
    # An explicit mesh: FSDP2's default takes CUDA whenever a GPU is visible, even for a CPU model.
    mesh = init_device_mesh(device.type, (world,)) if replicas == 1 else _hsdp_mesh(device.type, replicas)
    if frozen:
        model.requires_grad_(False).eval()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()  # offload: on the host
    shard = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": policy}
    for block in _blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward or frozen, **shard)
    # A trained root stays gathered after forward (FSDP2's default), as backward needs it at once.
    fully_shard(model, reshard_after_forward=True if frozen else None, **shard)
    return model


def _hsdp_mesh(device_type: str, replicas: int):
    """One mesh per process group, shared by the policy and the reference: each subgroup costs communicators."""
    key = (dist.group.WORLD, device_type, replicas)
    if key not in _meshes:
        _meshes.clear()
        _meshes[key] = init_device_mesh(device_type, (replicas, dist.get_world_size() // replicas),
                                        mesh_dim_names=("replicate", "shard"))
    return _meshes[key]


@contextlib.contextmanager
def inference(model: nn.Module):
    """Eval mode and no autograd for forward-only passes; then the previous mode back and the root resharded,
    which FSDP2 keeps gathered after forward for a backward, while the optimizer and checkpoints need shards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)
        model.reshard()


def load_from_rank0(model: nn.Module, full_model: nn.Module | None, device: torch.device, offload: bool = False):
    """Materialise a sharded meta-device model on `device` (offload: its shards on the host) and fill it from rank
    0's full CPU model (None on other ranks, which never hold more than one full tensor: each is broadcast)."""
    model.to_empty(device="cpu" if offload else device)
    state = full_model.state_dict() if full_model is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers are not sharded, and non-persistent ones (e.g. rotary inv_freq) are not in the state dict.
    for name, buf in model.named_buffers():
        if full_model is not None:
            buf.copy_(full_model.get_buffer(name))
        dist.broadcast(buf, src=0)
    for module in model.modules():  # offloaded: the buffers still go where forward runs
        module._buffers.update({k: b.to(device) for k, b in module._buffers.items() if b is not None})


def gather_full_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full state dict on CPU on rank 0 ({} elsewhere), floats cast to `dtype` if given; ties stay one tensor."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first = {}  # id(parameter) -> its first name: gathered over several ranks, each alias got a copy of its own
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state:
            state[name] = state[first.setdefault(id(param), name)]
    return _cast(state, dtype) if dtype is not None else state


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype`, each once, so aliases stay one tensor."""
    unique = {id(v): v for v in state.values() if v.is_floating_point()}
    cast = {i: v.to(dtype) for i, v in unique.items()}
    return {k: cast.get(id(v), v) for k, v in state.items()}


def save_pretrained(model: nn.Module, folder: str, dtype: torch.dtype, tokenizer=None,
                    extra: dict | None = None, merge=None) -> None:
    """A sharded Hugging Face model as a save_pretrained folder in `dtype`, plus save_files(tokenizer, extra).
    merge: float32 state -> (model to write with, state), e.g. folding LoRA in. Call on every rank; rank 0 writes."""
    state = gather_full_state_dict(model, torch.float32 if merge else dtype)

    def write():  # rank 0; the others wait on the store, however long the files take
        writer, weights = merge(state) if merge else (model, state)
        writer.save_pretrained(folder, state_dict=_cast(weights, dtype))
        writer.config.dtype = dtype  # save_pretrained records the float32 masters' dtype; record the export's
        writer.config.save_pretrained(folder)
        save_files(folder, tokenizer, extra)
    on_rank0(write, share=False)


def save_files(folder: str, tokenizer=None, extra: dict | None = None) -> None:
    """The tokenizer's files and each {file name: JSON-able} of `extra`, into `folder`: call on one rank."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for name, obj in (extra or {}).items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)


def exit_without_shutdown(code: int | str | None) -> None:
    """Exit now with sys.exit's `code`, skipping interpreter shutdown, where a gloo thread still releasing a
    collective's tensors can abort (SIGABRT) a run that wrote everything. Files are closed and flushed by then."""
    if isinstance(code, str):  # sys.exit("message") prints it
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))
