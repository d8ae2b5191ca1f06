"""Process group and FSDP2 sharding for Hugging Face causal LMs, one code path for 1..N ranks.

Copyable on its own: imports only the standard library and torch.

    rank, world, device = init_distributed()        # torchrun's env, or a world of one
    with torch.device("meta"):
        model = build_model()                        # no memory on any rank
    apply_ac(model)                                  # optional; always before apply_fsdp
    apply_fsdp(model, mp_policy)                     # each transformer block, then the root
    load_from_rank0(model, full_model_or_None, device)   # only rank 0 ever holds the full weights
    state = gather_full_state_dict(model)            # full float32 weights on rank 0, {} elsewhere
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class FSDPConfig:
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (non-reentrant): less memory, ~1/3 more compute."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after forward and gather again in backward (ZeRO-3); off is ZeRO-2."""


def init_distributed(timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Start the process group; returns (rank, world_size, device).

    Under torchrun (RANK is set) the rendezvous comes from its environment: nccl with one GPU per local
    rank when CUDA is available, gloo on CPU. Without torchrun this process is a world of one, so FSDP2
    and every collective run through exactly the same code.
    """
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
    else:
        # A HashStore needs no free port, so two single-process runs on one machine never collide.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


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


def apply_fsdp(model: nn.Module, mp_policy: MixedPrecisionPolicy, frozen: bool = False,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` in place with FSDP2: each transformer block, then the root.

    The root group holds everything outside the blocks (embeddings, final norm, output layer). Tied input
    and output embeddings are one parameter there, so the tie survives sharding and is gathered once.
    frozen=True prepares a reference model: no gradients, eval mode, same sharding.
    """
    if frozen:
        model.requires_grad_(False).eval()
    for block in _blocks(model):
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # A trained root stays gathered after forward (FSDP2's default), as backward needs it at once; a frozen
    # one has no backward, so it reshards, rather than hold the embeddings and output layer gathered for good.
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=True if frozen else None)
    return model


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


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded state dict on CPU in the master dtype on rank 0; an empty dict on other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

