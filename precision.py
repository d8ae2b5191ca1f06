"""Precision modes: one name maps to the compute dtype, the FSDP2 mixed-precision policy and the
loss scaler.

Copyable on its own: imports only the standard library and torch.

In every mode the sharded master weights, their gradients after reduction and the optimizer state
are float32; only the all-gathered copy used for forward and backward takes the compute dtype.

    name   forward/backward   gradient reduce-scatter   loss scaling
    fp32   float32            float32                   no
    bf16   bfloat16           float32                   no
    fp16   float16            float32                   torch.amp.GradScaler
    auto   bf16 on a CUDA device with native bfloat16 (Ampere or newer), otherwise fp32

On a CPU auto is fp32: bf16 crawls without native bf16 instructions (BENCHMARKS.md), and fp32 runs
alike on all. This runs as written:

    import torch
    from precision import PrecisionConfig, count_bad_steps, resolve_precision

    cpu = torch.device("cpu")
    auto = resolve_precision(PrecisionConfig(), cpu)  # --precision auto: fp32 on a CPU
    print(auto.name, auto.compute_dtype, auto.mp_policy.reduce_dtype, auto.scaler.is_enabled())
    fp16 = resolve_precision(PrecisionConfig(precision="fp16"), cpu)  # .warning: print it once
    # Steps toward --max-skipped-steps after a skipped one: fp16's overflow with a finite loss is
    # the scaler finding its scale (not counted); a non-finite loss counts.
    scaler = fp16.scaler
    print(count_bad_steps(0, True, 0.7, scaler), count_bad_steps(0, True, float("nan"), scaler))
"""

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionName = Literal["auto", "fp32", "bf16", "fp16"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionConfig:
    precision: PrecisionName = "auto"
    """Compute precision; master weights, gradient reduction and optimizer state stay float32."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Gradient reduce-scatter dtype. bf16 (with --precision bf16 only) halves the traffic but
    rounds the sum."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    max_skipped_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm (each skipped
    on all ranks). fp16 steps whose loss is finite but whose gradients overflow only lower the loss
    scale and do not count."""

    def __post_init__(self):
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm must be >= 0, got {self.max_grad_norm}")
        if self.max_skipped_steps < 1:
            raise ValueError(f"--max-skipped-steps must be >= 1, got {self.max_skipped_steps}")


@dataclass(frozen=True)
class Precision:
    name: str
    """The resolved mode: fp32, bf16 or fp16 (never auto)."""
    compute_dtype: torch.dtype
    """The dtype of the gathered parameters, activations and logits."""
    mp_policy: MixedPrecisionPolicy
    """FSDP2's: gather parameters in compute_dtype, reduce gradients in --reduce-dtype."""
    scaler: torch.amp.GradScaler
    """fp16's dynamic loss scaling; disabled otherwise, where scale, unscale_ and step pass
    through."""
    warning: str | None = None
    """What to know of this choice on this machine (slow here, or not what auto would pick), to
    print once; None when nothing."""


def resolve_precision(config: PrecisionConfig, device: torch.device) -> Precision:
    """The dtypes, FSDP2 policy and GradScaler of `config` on `device`; ValueError for a combination
    it can't run."""
    name = config.precision
    choices = ", ".join(get_args(PrecisionName))
    if name not in get_args(PrecisionName):
        raise ValueError(f"--precision {name!r} is not one of {choices}")
    # Emulation does not count: a V100 or T4 "supports" bf16 through float32 kernels, far slower
    # than fp16.
    native_gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(
        including_emulation=False
    )
    if name == "auto":
        name = "bf16" if native_gpu_bf16 else "fp32"
    if name == "bf16" and device.type == "cuda" and not native_gpu_bf16:
        raise ValueError(
            f"--precision bf16: {torch.cuda.get_device_name(device)} has no native bfloat16; "
            f"choose fp16 or fp32 ({choices})"
        )
    if name != "fp32" and device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"--precision {name}: not supported on device {device.type}; choose fp32 ({choices})"
        )
    if config.reduce_dtype not in ("fp32", "bf16"):
        raise ValueError(f"--reduce-dtype {config.reduce_dtype!r} is not one of fp32, bf16")
    if config.reduce_dtype == "bf16" and name != "bf16":
        raise ValueError(f"--reduce-dtype bf16 needs --precision bf16 (resolved precision: {name})")
    dtype = _DTYPES[name]
    warning = None
    if name == "bf16" and device.type == "cpu" and cpu_has_native_bf16() is False:
        warning = (
            "--precision bf16: this CPU has no native bfloat16 (no avx512_bf16 or amx_bf16 in "
            "/proc/cpuinfo): bf16 matmuls are emulated, many times slower than fp32; --precision "
            "fp32 (or auto) is faster here"
        )
    if name == "fp16" and device.type == "cpu":
        warning = (
            "--precision fp16 on a CPU: float16 compute with a dynamic loss scaler, as on a GPU; "
            "auto would pick fp32 here"
        )
    return Precision(
        name=name,
        compute_dtype=dtype,
        # Reduced in float32 by default: summing N bf16/fp16 gradients loses bits, and fp16 can
        # overflow mid-reduction.
        mp_policy=MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=_DTYPES[config.reduce_dtype]
        ),
        scaler=torch.amp.GradScaler(device.type, enabled=name == "fp16"),
        warning=warning,
    )


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has native bfloat16 (x86: avx512_bf16 or amx_bf16; Arm: bf16); None without
    cpuinfo."""
    try:
        with open(cpuinfo) as f:
            return any(
                word in ("avx512_bf16", "amx_bf16", "bf16")
                for line in f
                if line.startswith(("flags", "Features"))
                for word in line.split()
            )
    except FileNotFoundError:
        return None


def count_bad_steps(before: int, skipped: bool, loss: float, scaler: torch.amp.GradScaler) -> int:
    """Consecutive steps toward --max-skipped-steps after a step that had `before` behind it: 0
    after an update; one more after a skipped step, unless its loss is finite and fp16's gradients
    overflowed, which is the scaler finding its scale (then as before), while the scale is at least
    1 (below, halving is no cure)."""
    if not skipped:
        return 0
    if scaler.is_enabled() and math.isfinite(loss) and scaler.get_scale() >= 1:
        return before
    return before + 1
