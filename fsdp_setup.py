"""Process group and FSDP2 sharding for Hugging Face causal LMs, one code path for 1..N ranks.

Copyable on its own: imports only the standard library and torch.

    rank, world, device = init_distributed()   # torchrun's env, or a world of one
    apply_fsdp(model, mp_policy)                # each transformer block, then the root
    state = gather_full_state_dict(model)       # full float32 weights on rank 0, {} elsewhere
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def init_distributed(timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Start the process group; returns (rank, world_size, device).

    Under torchrun (RANK is set) the rendezvous comes from its environment: nccl with one GPU per local
    rank when CUDA is available, gloo on CPU. Without torchrun this process is a world of one, so FSDP2
    and every collective run through exactly the same code.
    """
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        # A HashStore needs no free port, so two single-process runs on one machine never collide.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def close_distributed() -> None:
    """Wait for every rank, then tear the process group down (a rank leaving early aborts the others)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
                     "and no ModuleList of repeated layers to shard")


def apply_fsdp(model: nn.Module, mp_policy: MixedPrecisionPolicy, frozen: bool = False,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` in place with FSDP2: each transformer block, then the root.

    The root group holds everything outside the blocks (embeddings, final norm, output layer). Tied input
    and output embeddings are one parameter there, so the tie survives sharding and is gathered once.
    frozen=True prepares a reference model: no gradients, eval mode, same sharding.
    """
    if frozen:
        model.requires_grad_(False).eval()
    block_class = find_block_class(model)
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root keeps FSDP2's default: it stays gathered after forward, as backward needs it at once.
    fully_shard(model, mp_policy=mp_policy)
    return model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded state dict on CPU in the master dtype on rank 0; an empty dict on other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
