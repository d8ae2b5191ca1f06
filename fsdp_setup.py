"""Process group and FSDP2 sharding for Hugging Face causal LMs, one code path for 1..N ranks.

Copyable on its own: imports only the standard library and torch.

    rank, world, device = init_distributed()        # torchrun's env, or a world of one; nccl + gloo on CUDA
    model = build_sharded(make_model, full_model_or_None, mp_policy, device, FSDPConfig())
    # = on the meta device: apply_ac (optional), compile (optional), apply_fsdp (each block, then the root),
    #   then load_from_rank0: only rank 0 ever holds the full weights
    with inference(model): model(**batch)           # eval, no grad; then train mode back and resharded
    path = on_rank0(lambda: build_cache())           # rank 0 works, every rank gets its result (or error)
    state = gather_full_state_dict(model)            # full weights on rank 0 (ties kept), {} elsewhere
    save_pretrained(model, "final", torch.bfloat16, tokenizer)   # a Hugging Face folder, written by rank 0
"""

import contextlib
import json
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class FSDPConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto is cuda when a GPU is visible (nccl for GPU tensors, gloo for CPU ones), else cpu (gloo)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (non-reentrant): less memory, ~1/3 more compute."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after forward and gather again in backward (ZeRO-3); off is ZeRO-2.
    A frozen reference always reshards: it has no backward that would."""
    compile: bool = False
    """torch.compile each transformer block (dynamic shapes: micro-batches vary in length). The first steps are
    slower while it compiles. Order per block: activation checkpointing, then compile, then FSDP."""
    unsharded_grad_accumulation: bool = False
    """Accumulate micro-batch gradients unsharded and reduce-scatter once per step: fewer collectives, but every
    rank holds a full gradient in the reduce dtype (float32: 4 bytes per parameter) until the last micro-batch.
    Off: reduce-scatter after every micro-batch, so only gradient shards are ever kept."""
    replicas: int = 1
    """HSDP: R copies of the model, each sharded over world/R consecutive ranks (one node each when that is its
    GPU count): weights are gathered and gradients reduce-scattered within a node, and only gradient shards
    cross nodes (an all-reduce over the R copies). 1: every rank shards one copy (FSDP)."""

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Start the process group; returns (rank, world_size, device).

    device: "cuda", "cpu", or "auto" (cuda when a GPU is visible). Under torchrun (RANK is set) the rendezvous
    comes from its environment; without it this process is a world of one, so FSDP2 and every collective run
    through exactly the same code. On CUDA the group has two backends: nccl for CUDA tensors and gloo for CPU
    ones. Our own collectives use device tensors, but PyTorch's object collectives, barriers and checkpoint
    planning, and any CPU tensor a later change reduces, then work too instead of failing only on GPUs.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {device!r} is not one of auto, cuda, cpu")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    device = torch.device("cuda", _local_gpu()) if cuda else torch.device("cpu")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        # Before the first allocation: segments that grow in place, instead of fragmenting under the changing
        # shapes of padded micro-batches.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(device)
        # cuDNN attention (SDPA's first choice on Hopper) builds a plan for every new (batch, length), ~15 ms of
        # host time each, and each padded micro-batch brings a new length: in issue 14's profile of the 1B bench
        # (H100), turning it off took this trainer from 16.8 to 25.9 pairs/s. Flash attention needs no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
    else:
        # A HashStore needs no free port, so two single-process runs on one machine never collide.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def on_rank0(fn, share: bool = True):
    """fn() on rank 0 alone; its result (share=False: None elsewhere) or its failure then reaches every rank.

    The other ranks wait on the process group's key-value store, not in a collective: a long rank-0 phase
    (tokenizing a large dataset, loading or writing a full model) may outlast the collective timeout, and a
    failure on rank 0 reaches them the moment it happens. A ValueError stays one on every rank, so each
    reports bad input the same way; any other failure is a RuntimeError on the other ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    _rank0_calls.append(None)  # every rank calls on_rank0 in the same order: the n-th call's key
    key, store = f"dpo/on_rank0/{len(_rank0_calls)}", dist.distributed_c10d._get_default_store()
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


_rank0_calls = []
_RANK0_WAIT = timedelta(hours=24)  # the longest rank-0 phase the other ranks wait for


def _local_gpu() -> int:
    """This process's GPU: its local rank among the visible ones, or the only one when a launcher (SLURM,
    Kubernetes) shows each process one GPU of its own through CUDA_VISIBLE_DEVICES."""
    local_rank, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if visible == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    if local_rank >= visible:
        raise ValueError(f"LOCAL_RANK {local_rank} but this process sees only {visible} GPUs: start at most "
                         f"{visible} processes per node, or show each process its own GPU (CUDA_VISIBLE_DEVICES)")
    return local_rank


def find_block_class(model: nn.Module) -> type[nn.Module]:
    """The transformer block class: from the model's `_no_split_modules`, else the longest ModuleList of
    one repeated class (the decoder layer list). Raises ValueError when neither exists."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    lists = [m for m in lists if len({type(x) for x in m}) == 1]
    if lists:
        return type(max(lists, key=len)[0])
    raise ValueError(f"no transformer block class found in {type(model).__name__}: it has no _no_split_modules "
                     "and no ModuleList of repeated layers to shard or checkpoint")


def _blocks(model: nn.Module) -> list[nn.Module]:
    block_class = find_block_class(model)
    return [m for m in model.modules() if isinstance(m, block_class)]


def apply_ac(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on each transformer block, in place (module names and
    state-dict keys are unchanged). Order: activation checkpointing, then (compile, then) apply_fsdp, so
    the recomputation in backward re-gathers each block's parameters through FSDP's hooks."""
    for block in _blocks(model):
        checkpoint(block)


def build_sharded(make_model, full_model: nn.Module | None, mp_policy: MixedPrecisionPolicy, device: torch.device,
                  config: FSDPConfig, frozen: bool = False) -> nn.Module:
    """make_model() built on the meta device (no memory), each block checkpointed (config, not when frozen) and
    compiled (config), sharded, then filled from rank 0's `full_model` (None on other ranks). frozen=True: a
    reference. Its weights, like any that make_model() made frozen (requires_grad False), are stored in
    mp_policy's compute dtype."""
    with torch.device("meta"):
        model = make_model()
    if mp_policy.param_dtype is not None:  # weights that never change (a reference, LoRA's frozen base) need no
        for param in model.parameters():   # float32 master copy: kept in the compute dtype, gathered without a cast
            if frozen or not param.requires_grad:
                param.data = param.data.to(mp_policy.param_dtype)
    if config.activation_checkpointing and not frozen:
        apply_ac(model)
    if config.compile:
        # After checkpointing, so the recomputation is compiled too; before FSDP, whose hooks then stay outside
        # the compiled code (dynamo skips FSDP hooks). Module.compile keeps names and state-dict keys.
        for block in _blocks(model):
            block.compile(dynamic=True)
    apply_fsdp(model, mp_policy, device, frozen=frozen, reshard_after_forward=config.reshard_after_forward,
               replicas=config.replicas)
    load_from_rank0(model, full_model, device)
    return model


def apply_fsdp(model: nn.Module, mp_policy: MixedPrecisionPolicy, device: torch.device, frozen: bool = False,
               reshard_after_forward: bool = True, replicas: int = 1) -> nn.Module:
    """Shard `model` in place with FSDP2 over every rank on `device`: each transformer block, then the root.

    The root group holds everything outside the blocks (embeddings, final norm, output layer). Tied input
    and output embeddings are one parameter there, so the tie survives sharding and is gathered once.
    frozen=True prepares a reference model: no gradients, eval mode, same sharding. replicas > 1: HSDP over a
    (replicas, world / replicas) mesh, rank r in replica r // (world / replicas).
    """
    world = dist.get_world_size()
    if world % replicas:
        raise ValueError(f"--replicas {replicas} does not divide the {world} ranks")
    # An explicit mesh: FSDP2's default mesh takes CUDA whenever a GPU is visible, even for a CPU model. With
    # a 2D mesh fully_shard shards over the last dimension and replicates over the first.
    mesh = init_device_mesh(device.type, (world,)) if replicas == 1 else _hsdp_mesh(device.type, replicas)
    if frozen:
        model.requires_grad_(False).eval()
    # A frozen model has no backward, which is what reshards a block kept gathered after forward: it always
    # reshards, or every rank would hold the whole reference. A trained root stays gathered after forward
    # (FSDP2's default), as backward needs it at once.
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward or frozen)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True if frozen else None)
    return model


def _hsdp_mesh(device_type: str, replicas: int):
    """The (replicas, world / replicas) mesh, made once per process group: the policy and the reference share
    its subgroups (each new one is another set of communicators)."""
    key = (dist.group.WORLD, device_type, replicas)
    if key not in _meshes:
        _meshes.clear()
        _meshes[key] = init_device_mesh(device_type, (replicas, dist.get_world_size() // replicas),
                                        mesh_dim_names=("replicate", "shard"))
    return _meshes[key]


_meshes = {}


@contextlib.contextmanager
def inference(model: nn.Module):
    """Eval mode and no autograd for forward-only passes (evaluation, sampling, reference log-probs); then the
    previous mode back and the parameters resharded: FSDP2 keeps the root gathered after a forward, for the
    backward that usually follows, and the optimizer and checkpoints must be handed the shards again."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)
        model.reshard()


def load_from_rank0(model: nn.Module, full_model: nn.Module | None, device: torch.device) -> None:
    """Materialise a sharded (meta-device) model on `device` and fill it from rank 0's full model.

    Rank 0 passes its fully loaded CPU model; other ranks pass None and never hold more than one full
    tensor at a time: each is broadcast, and every rank keeps only its shard.
    """
    model.to_empty(device=device)
    state = full_model.state_dict() if full_model is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    # Buffers are not sharded, and non-persistent ones (e.g. rotary inv_freq) are not in the state dict.
    for name, buf in model.named_buffers():
        if full_model is not None:
            buf.copy_(full_model.get_buffer(name))
        dist.broadcast(buf, src=0)


def gather_full_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full, unsharded state dict on CPU on rank 0, floating tensors cast to `dtype` (default: the master
    dtype); an empty dict on other ranks. Tied parameters (input and output embeddings) are one tensor under
    each of their names, as in the model, so save_pretrained writes them once whatever the world size."""
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
    """A sharded Hugging Face model as a save_pretrained folder: weights gathered in `dtype` (the same tensor
    names as the model's own save_pretrained), its config recording that dtype, the tokenizer, and each
    {file name: JSON-able} of `extra`. merge: state -> (model, state), applied on rank 0 to the float32 state
    before the cast, returns the model to write it with (e.g. LoRA adapters folded into the base model's
    weights). Call on every rank; rank 0 writes."""
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
