"""Each GPU's memory for a training run, known before launch, on any machine. What a step keeps
between steps (float32 master weights, AdamW's moments, frozen weights, the reference: each rank's
shards) comes from the sharded model's own shapes. What the step makes and frees (FSDP2's gathered
blocks and gradient reductions, the activations, the output layer and the loss, the gradients) is
traced: the step's own code runs on fake tensors, which have shapes and dtypes but no memory and
no values, and FSDP2's collectives move nothing. So the plan reads no weights and needs no GPU.

Copyable on its own: imports only the standard library and torch. This runs as written, on a CPU:

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import memory

    store = dist.HashStore()  # a world of one, in this process
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def build():  # (policy, reference) as training builds them, sharded
        with torch.device("meta"):  # parameters as shapes alone: the plan reads no weights
            model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
        return fully_shard(model), None

    def collate(size):  # a host batch of `size` rows of 256 tokens
        return torch.zeros(size * 256, 512, device="cpu")

    def micro_batch(model, rows):  # forward and backward of one micro-batch
        model(rows).square().mean().backward()

    # 4 rows per GPU per step: a step's peak at each micro-batch size (1, 2, 4), and its parts
    plan = memory.plan_run(build, collate, micro_batch, 4, torch.device("cpu"))
    print(memory.format_plan(plan, card_gb=80.0, size=4, title="memory plan:"))
    print(memory.largest_fitting(plan, card_gb=80.0))  # ValueError if none fits
    dist.destroy_process_group()

The plan counts tensors, as torch.cuda.max_memory_allocated does (which also counts cuBLAS's
workspaces: WORKSPACE_GB); what the caching allocator does not hold (the CUDA context, NCCL's
buffers) and its fragmentation are the stated RESERVED_GB and FITS: a micro-batch size fits when
its peak plus RESERVED_GB is at most FITS of the card.
"""

import contextlib
import logging
import math
import os
import sys
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp
from torch._dynamo import convert_frame
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# GB as peak_mem_gb, nvidia-smi and a card's name count them ("80GB"): 2^30 bytes.
GB = 2**30
# What a GPU holds besides the caching allocator's blocks: the CUDA context with its kernels, and
# NCCL's buffers (several per communicator). Not measured here: an allowance, to be checked on GPUs
# against torch.cuda.mem_get_info (bench/plan_gpu.sh).
RESERVED_GB = 2.0
# The share of a card a run may plan to fill: the caching allocator rounds and fragments blocks.
FITS = 0.9
# How far a run's measured peak may be from its plan before the run warns: a share of it, or
# WORKSPACE_GB where that is more.
TOLERANCE = 0.1
# cuBLAS's workspaces, one per stream that runs a matmul (32 MiB each on Hopper): torch takes them
# from its caching allocator, so max_memory_allocated counts them, and the plan, of tensors, not.
WORKSPACE_GB = 0.1
# Where FSDP2's code lives: storages made or resized there are its gathered blocks and reductions.
# Each a folder's path with its separator: torch's is not a prefix of torchvision's.
_FSDP_DIR = os.path.join(os.path.dirname(fsdp.__file__), "")
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_FSDP_PART = "gathered blocks and reductions (FSDP2)"
MOMENTS = "AdamW's moments and steps"


@dataclass
class PlanConfig:
    plan: bool = False
    """Print each GPU's memory for this run, its parts and the peak at each micro-batch size, then
    exit: nothing trains and no weights are read (the model's config only)."""
    plan_gpus: int | None = None
    """GPUs that --plan plans for (with --replicas: HSDP). Default: WORLD_SIZE, else the visible
    GPUs, else 1."""
    gpu_memory: float | None = None
    """One GPU's memory in GB (2^30 bytes: 80 for an 80GB card), for --plan and --micro-batch-size
    auto. Default: the visible GPU's."""
    plan_responses: int = 2
    """Responses per row that --plan assumes without --data (a pair file's: 2)."""

    def __post_init__(self):
        if self.plan_gpus is not None and self.plan_gpus < 1:
            raise ValueError(f"--plan-gpus must be >= 1, got {self.plan_gpus}")
        if self.gpu_memory is not None and not 0 < self.gpu_memory < float("inf"):
            raise ValueError(f"--gpu-memory must be > 0 GB, got {self.gpu_memory}")
        if self.plan_responses < 2:
            raise ValueError(f"--plan-responses must be >= 2, got {self.plan_responses}")


@dataclass
class Plan:
    """One GPU's memory for a step at each micro-batch size: its peak, and what the peak holds."""

    per_rank: int
    """Rows per GPU per step: a micro-batch size that divides it trains."""
    peaks: dict[int, float] = field(default_factory=dict)
    """Micro-batch size -> the step's peak, GB."""
    parts: dict[int, dict[str, float]] = field(default_factory=dict)
    """Micro-batch size -> GB by part at that peak (they add up to it)."""
    host: dict[str, float] = field(default_factory=dict)
    """GB by part kept in host memory (--cpu-offload), not on the GPU."""


def planned_gpus(config: PlanConfig) -> int:
    """With --plan, the GPUs planned for: --plan-gpus, else WORLD_SIZE, else the visible GPUs,
    else 1; 0 without."""
    if not config.plan:
        return 0
    return (
        config.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or torch.cuda.device_count() or 1
    )


def plan_run(
    build,
    collate,
    micro_batch,
    per_rank: int,
    device: torch.device,
    sizes: list[int] | None = None,
    unsharded_accumulation: bool = False,
    offload: bool = False,
    parts_from: dict[str, str] | None = None,
    context: contextlib.AbstractContextManager | None = None,
) -> Plan:
    """The plan (plan_memory) of a run's step on the models and rows that the run's own code makes:
    build() -> (policy, reference) as plan_memory takes them; collate(size) -> the host batch
    traced at micro-batch `size` (its longest rows, for a bound); at `sizes`, else at each of
    micro_batch_sizes(per_rank). `context` is entered around the trace alone: say, one that sends
    the model down a GPU's path on a CPU. The rest is plan_memory's. Callables, not models and
    batches: this file imports none of the run's code, and the run hands over how it builds and
    lays out, so that what is planned is what trains."""
    rows = {size: collate(size) for size in sizes or micro_batch_sizes(per_rank)}
    policy, reference = build()
    with context or contextlib.nullcontext():
        return plan_memory(
            policy,
            reference,
            micro_batch,
            rows,
            per_rank,
            device,
            unsharded_accumulation,
            offload,
            parts_from,
        )


def plan_memory(
    policy: nn.Module,
    reference: nn.Module | None,
    micro_batch,
    rows: dict,
    per_rank: int,
    device: torch.device,
    unsharded_accumulation: bool = False,
    offload: bool = False,
    parts_from: dict[str, str] | None = None,
) -> Plan:
    """The plan of a step for each micro-batch size in `rows` ({size: a host batch of `size` rows}),
    on `policy` and `reference` as training builds them: FSDP2-sharded, parameters on the meta
    device (made fake tensors on `device` here); reference None, or sharing the policy's
    parameters as LoRA's does. micro_batch(policy, batch) runs one micro-batch's forward and
    backward, the reference's log-probs given: its forward keeps nothing for backward.

    What a step keeps between steps comes from the shards. One micro-batch is traced, reducing its
    gradients; a step of several is planned as its last, which holds every gradient throughout
    (each block's reduction made, then added in). With --unsharded-grad-accumulation the first
    micro-batch (no reduction: unsharded gradients kept) is traced too. parts_from: {source file:
    part}, naming storages that code in that file makes (say, the loss's: "output layer and
    loss"); FSDP2's own are its gathered blocks and reductions, what the step leaves in .grad the
    gradients, the rest activations. A transformers model's rows are each traced as one sequence,
    as training runs them (_one_sequence_per_row): a plan of packed rows (positions restarting,
    no mask) would miss their mask."""
    # An op without a fake kernel fails here rather than run its real one on zeros, on the GPU.
    fake = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    # A kernel that fails on fake tensors reaches the user as one line (below), not also as the
    # traceback that fake tensors log; the level is restored for the run's own errors.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    # Each code object Dynamo has met: it meets one before it decides to skip it.
    met = len(convert_frame.input_codes.seen)
    try:
        for model in (policy, reference):
            if model is not None:
                # Pinned host memory has the bytes of any other, and fake tensors cannot be pinned.
                _unpin(model)
                with fake:
                    model.to_empty(device=device)
        state = _state_parts(policy, reference)
        plan = Plan(per_rank)
        # Offloaded, the policy's shards, gradients and moments stay in host memory.
        if offload:
            plan.host = {k: state.pop(k) / GB for k in list(state) if k != "reference"}
        for size, batch in rows.items():
            syncs = [False, True] if size < per_rank and unsharded_accumulation else [True]
            with fake, _Trace(parts_from or {}) as trace, _one_sequence_per_row():
                for sync in syncs:
                    policy.set_requires_gradient_sync(sync)
                    try:
                        micro_batch(policy, batch)
                    except RuntimeError as e:
                        # A kernel's fake version may refuse what its real one takes
                        # (transformers' grouped experts take bf16 alone on fake tensors).
                        raise ValueError(
                            f"the memory plan cannot trace this step on fake tensors: {e}"
                        ) from None
                # Frozen weights get no .grad.
                grads = {
                    trace.ids.get(_key(_local(p.grad)))
                    for p in policy.parameters()
                    if p.grad is not None
                }
                policy.zero_grad(set_to_none=True)
            # Sharded accumulation holds every gradient through a step of several micro-batches.
            held = size < per_rank and not unsharded_accumulation
            parts = {**state, **trace.peak(grads, held, offload)}
            plan.parts[size] = {k: v / GB for k, v in parts.items()}
            plan.peaks[size] = sum(parts.values()) / GB
        return plan
    finally:
        logger.setLevel(level)
        # Dynamo skips for good the code of a compiled function it first meets under a dispatch
        # mode (the trace's): the run's own would never compile. Forget what it met.
        if len(convert_frame.input_codes.seen) != met:
            torch._dynamo.reset()


@contextlib.contextmanager
def _one_sequence_per_row():
    """Inside, transformers takes each row for one sequence, as it finds rows in training to be: a
    row given no positions (the model numbers it 0, 1, ...) and no mask. It tells by reading the
    positions, and a fake tensor has none to read: it would take the rows for packed sequences and
    build their mask, and SDPA would take its masked kernel, with GQA's key and value heads
    repeated, where training takes the causal one with no mask. Found in sys.modules, not
    imported: a transformers model has imported it, and this file needs no transformers."""
    masking = sys.modules.get("transformers.masking_utils")
    found = getattr(masking, "find_packed_sequence_indices", None)
    if masking:
        masking.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        if masking:
            masking.find_packed_sequence_indices = found


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    """transformers' find_packed_sequence_indices on rows of one sequence each: None."""


def _unpin(model: nn.Module) -> None:
    """FSDP2's offloaded shards of `model` (on the meta device) set to be made in pageable host
    memory, as on a CPU."""
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else []:
                param.pin_memory = False


def choose(plan: Plan, config: PlanConfig, device: torch.device, micro) -> tuple[int, str]:
    """(the micro-batch size, the plan as a table): `micro`, or for "auto" the largest that fits
    the card. The card's memory: --gpu-memory, else the GPU of `device`'s; none on a CPU without
    --gpu-memory."""
    card = config.gpu_memory
    if card is None and device.type == "cuda":
        card = torch.cuda.get_device_properties(device).total_memory / GB
    if micro == "auto":
        micro = largest_fitting(plan, card)
    return micro, format_plan(
        plan, card, micro, f"memory plan for each GPU, of {dist.get_world_size()}:"
    )


def fits(peak_gb: float, card_gb: float | None) -> bool:
    """Whether a step's peak fits a card: with RESERVED_GB, at most FITS of it."""
    return card_gb is not None and peak_gb + RESERVED_GB <= FITS * card_gb


def largest_fitting(plan: Plan, card_gb: float | None) -> int:
    """--micro-batch-size auto: the largest planned size that divides the rows per GPU and fits.
    ValueError without a card, or where none fits."""
    if card_gb is None:
        raise ValueError(
            "--micro-batch-size auto needs a card to fit: a GPU, or --gpu-memory GB on a CPU"
        )
    fitting = [s for s, peak in plan.peaks.items() if not plan.per_rank % s and fits(peak, card_gb)]
    if not fitting:
        smallest = min(plan.peaks)
        raise ValueError(
            f"--micro-batch-size auto: even {smallest} row per GPU needs "
            f"{plan.peaks[smallest] + RESERVED_GB:.1f} GB of a {card_gb:.1f} GB card (with "
            f"{RESERVED_GB:g} GB for CUDA and NCCL); try --activation-checkpointing, --lora-rank, "
            "more GPUs or a shorter --max-length"
        )
    return max(fitting)


def format_plan(plan: Plan, card_gb: float | None, size: int, title: str) -> str:
    """The plan as a table: micro-batch `size`'s parts and peak (and the card's memory), then each
    size's peak and, with a card, whether it fits; under `title`."""
    host = {f"{part}, in host memory": gb for part, gb in plan.host.items()}
    card = "(no card: --gpu-memory GB tells which sizes fit)"
    if card_gb is not None:
        card = f"of a {card_gb:.1f} GB card, {FITS:.0%} usable, {RESERVED_GB:g} GB reserved"
    lines = [
        title,
        *(f"  {part:<44} {gb:9.3f} GB" for part, gb in {**plan.parts[size], **host}.items()),
        f"  {f'peak at micro-batch {size}':<44} {plan.peaks[size]:9.3f} GB {card}",
        "  micro-batch   peak GB" + ("   fits" if card_gb is not None else ""),
    ]
    for s, peak in plan.peaks.items():
        verdict = ""
        if card_gb is not None:
            verdict = "   yes" if fits(peak, card_gb) else "   no"
        if plan.per_rank % s:
            verdict += f" (does not divide {plan.per_rank} rows per GPU)"
        lines.append(f"  {s:>11} {peak:9.3f}{verdict}")
    return "\n".join(lines)


def fullest_rank_gb(
    size: int, new_run: bool, device: torch.device, plan_step, *args
) -> float | None:
    """The largest over the ranks of each rank's planned peak of its first step at micro-batch
    `size` (plan_step(*args): that rank's Plan): in a new run without AdamW's moments, which the
    step's update makes. A check is not the run: where plan_step fails on any rank, that rank says
    why, and every rank gets None, through the one collective they all make (on `device`: nccl
    takes no CPU tensor), so that none waits and training goes on."""
    try:
        plan = plan_step(*args)
        peak = plan.peaks[size]
        if new_run:
            peak -= plan.parts[size].get(MOMENTS, 0.0)
    except Exception as e:
        print(
            f"warning: memory check skipped on rank {dist.get_rank()}: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        peak = math.inf
    planned = torch.tensor(peak, device=device)
    dist.all_reduce(planned, op=dist.ReduceOp.MAX)
    fullest = planned.item()
    # Rank 0 says so where another rank failed and it did not (a failed rank has said why).
    if fullest == math.inf and peak < math.inf and dist.get_rank() == 0:
        print(
            "warning: memory check skipped: another rank could not plan its first step (its line "
            "says why)",
            file=sys.stderr,
        )
    return fullest if fullest < math.inf else None


def check_line(planned_gb: float, measured_gb: float) -> str:
    """A line with a step's planned peak beside its measured one (torch.cuda.max_memory_allocated):
    a warning when they differ by more than TOLERANCE of the measured (or WORKSPACE_GB)."""
    line = f"memory: peak {measured_gb:.2f} GB at the first step, planned {planned_gb:.2f} GB"
    if abs(planned_gb - measured_gb) > max(TOLERANCE * measured_gb, WORKSPACE_GB):
        line = f"warning: {line}, off by more than {TOLERANCE:.0%}: the plan (--plan) is wrong here"
    return line


def micro_batch_sizes(per_rank: int) -> list[int]:
    """The sizes a plan lists: powers of two below the rows per GPU, then all of them."""
    return [2**i for i in range(per_rank.bit_length()) if 2**i < per_rank] + [per_rank]


def _state_parts(policy: nn.Module, reference: nn.Module | None) -> dict[str, int]:
    """Bytes by part of what a rank keeps between steps: its shards of the weights trained (float32
    masters), of frozen weights (LoRA's base) and of the reference, AdamW's two float32 moments of
    each weight trained, and its step count (a float32 per weight, on the device with the fused
    AdamW)."""
    parts = {"weights trained (float32 masters)": 0, "frozen weights": 0, "reference": 0}
    # Storage key -> (part, shard): each storage once, as the policy's where the reference shares
    # it (LoRA's base).
    storages = {}
    for param in policy.parameters():
        part = "weights trained (float32 masters)" if param.requires_grad else "frozen weights"
        storages[_key(_local(param))] = (part, _local(param))
    for param in reference.parameters() if reference is not None else []:
        storages.setdefault(_key(_local(param)), ("reference", _local(param)))
    for part, local in storages.values():
        parts[part] += local.untyped_storage().nbytes()
    parts[MOMENTS] = sum(8 * _local(p).numel() + 4 for p in policy.parameters() if p.requires_grad)
    return {k: v for k, v in parts.items() if v}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an op's arguments or outputs (tensors, and lists or tuples of them), in
    order."""
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _kernel_buffers(func, args) -> int:
    """Bytes that a GPU kernel makes for itself inside the op `func`, which no dispatch mode sees
    (the caching allocator counts them): CUDA flash attention's backward (FlashAttention-2's
    mha_bwd, as torch vendors it) accumulates the query's gradient in float32, (B, T, H, D) with T
    rounded up to 128 and D to 32, beside the softmax's float32 (B, H, T) row sums, and with fewer
    key than query heads (GQA) expands the key's and value's gradients to every head."""
    if func is not torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
        return 0
    query, key = args[1], args[2]  # (B, H, T, D), (B, H_kv, T_kv, D)
    batch, heads, length, dim = query.shape
    rounded = -(-length // 128) * 128
    buffers = 4 * batch * heads * rounded * (-(-dim // 32) * 32 + 1)
    if key.shape[1] != heads:
        buffers += 2 * batch * heads * key.shape[2] * dim * key.element_size()
    return buffers


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Trace(TorchDispatchMode):
    """Every storage that ops make while it is on, and every resize of a storage (how FSDP2 frees
    and refills its gathered parameters), as events (id, change in bytes, part): the peak of their
    sum, and what it holds (peak)."""

    def __init__(self, parts_from: dict[str, str]):
        super().__init__()
        self.parts_from = parts_from
        # (storage id, change in bytes, part: None where a storage goes) in order.
        self.events = []
        # Key (address) -> id of each storage alive, and id -> bytes of each storage seen.
        self.ids = {}
        self._bytes = {}
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self):
        # FSDP2 frees and refills storages in place, which no dispatch mode sees.
        def resize_(storage, size):
            self._resize(storage, size)
            self._record(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(a) for a in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            # An op's output on an input's storage (a view, an in-place op) is no new memory.
            if _key(tensor) not in inputs:
                self._record(tensor.untyped_storage())
        # A kernel's own buffers, made and freed inside the op, beside its outputs.
        buffers = _kernel_buffers(func, args)
        if buffers:
            self.events += [(-1, buffers, self._part()), (-1, -buffers, None)]
        return out

    def _record(self, storage) -> None:
        """A storage's bytes now: a new one, or one resized."""
        key = storage._cdata
        # A storage not seen before gets the next id.
        storage_id = self.ids.setdefault(key, len(self._bytes))
        if storage_id not in self._bytes:
            self._bytes[storage_id] = 0
            # A storage's Python object lives as long as its memory does.
            weakref.finalize(storage, self._drop, key, storage_id)
        size = storage.nbytes()
        if size != self._bytes[storage_id]:
            self.events.append((storage_id, size - self._bytes[storage_id], self._part()))
            self._bytes[storage_id] = size

    def _drop(self, key: int, storage_id: int) -> None:
        # One that goes after the trace has ended goes after its peak too: no part at it changes.
        if self._bytes[storage_id]:
            self.events.append((storage_id, -self._bytes[storage_id], None))
        if self.ids.get(key) == storage_id:
            del self.ids[key]

    def _part(self) -> str:
        """The part a storage made now belongs to, by the code making it: the innermost frame on the
        Python stack (below this file's own) in FSDP2's files, or outside torch's; that frame's
        file in parts_from names its part, any other file's are activations (the model's code, or
        backward's)."""
        for frame, _ in traceback.walk_stack(sys._getframe(1)):
            name = frame.f_code.co_filename
            if name.startswith(_FSDP_DIR):
                return _FSDP_PART
            if name != __file__ and not name.startswith(_TORCH_DIR):
                return self.parts_from.get(name, "activations")
        return "activations"

    def peak(self, gradients: set, held: bool, offload: bool) -> dict[str, int]:
        """Bytes by part at the peak of the events' running sum. `gradients`: the ids of the
        storages the step left in .grad. held: every gradient is held from the start (a later
        micro-batch of the step), each made here only as a reduction's result to be added in and
        freed; offload: gradients are in host memory, not counted."""
        sizes = {i: 0 for i in gradients}
        for storage_id, change, _ in self.events:
            if storage_id in sizes:
                sizes[storage_id] = max(sizes[storage_id], change)
        kept = sum(sizes.values()) if held and not offload else 0
        # Bytes alive by the part each storage was made as: now, and at the peak of their sum.
        now = {_FSDP_PART: 0, "gradients": kept}
        best = dict(now)
        made_as = {}
        for storage_id, change, part in self.events:
            if storage_id in sizes:
                if offload or (held and change < 0):
                    continue
                # Held, a gradient made here is a reduction's result, added into its held
                # gradient and freed at once.
                part = _FSDP_PART if held else "gradients"
            part = made_as.setdefault(storage_id, part)
            now[part] = now.get(part, 0) + change
            if sum(now.values()) > sum(best.values()):
                best = dict(now)
            if storage_id in sizes and held:
                now[part] -= change
        return {k: v for k, v in best.items() if v}
