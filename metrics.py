"""What a run reports: DPO pair statistics summed on device and reduced once per step, memory, MFU, the
console (rank 0 only) and metrics.jsonl.

Copyable on its own: imports only the standard library and torch.

    sums += pair_sums(out, weight)           # per micro-batch, no host sync
    dist.all_reduce(sums)                    # once per step
    row = pair_means(sums, n_pairs)          # {"loss": ..., "rewards/accuracies": ..., ...}
    log = RunLog("runs/x", resume_step=0, samples=True, wandb_project=None, config={})
    log.write({"step": 1, "split": "train", **row}); log.close()   # metrics.jsonl (rank 0), metrics.png
"""

import json
import os
import pathlib
import resource
import sys

import torch
import torch.distributed as dist

PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


def pair_sums(out: dict, weight: torch.Tensor) -> torch.Tensor:
    """Weighted sums over pairs of each PAIR_METRICS entry, as one (7,) tensor: no host sync.

    out: per-pair (B,) tensors "losses", "chosen_rewards", "rejected_rewards", "chosen_logps",
    "rejected_logps"; weight: (B,), 0 for pairs that must not count.
    """
    cr, rr = out["chosen_rewards"], out["rejected_rewards"]
    per_pair = [out["losses"].detach(), cr, rr, (cr > rr).float(), cr - rr, out["chosen_logps"],
                out["rejected_logps"]]
    return torch.stack([(x * weight).sum() for x in per_pair])


def pair_means(sums: torch.Tensor, count: float, keys: tuple[str, ...] = PAIR_METRICS) -> dict:
    """{metric name: sum / count} for the first len(PAIR_METRICS) entries of `sums`, those named in `keys`."""
    return {k: v / count for k, v in zip(PAIR_METRICS, sums.tolist()) if k in keys}


def step_metrics(sums: torch.Tensor, peaks: torch.Tensor, seconds: float, batch_size: int,
                 keys: tuple[str, ...] = PAIR_METRICS) -> dict:
    """A train row from a step's reduced sums [PAIR_METRICS..., non-padding tokens, all tokens, model FLOPs] and
    maxima [peak memory, ...]: pair means (those in `keys`), throughput, padding efficiency, FLOPs, the fullest
    rank's memory."""
    tokens, slots, flops = sums[-3:].tolist()
    return {**pair_means(sums[:-3], batch_size, keys), "tokens_per_s": tokens / seconds,
            "pairs_per_s": batch_size / seconds, "padding_efficiency": tokens / slots, "flops": flops,
            "peak_mem_gb": peaks[0].item()}


def flop_coefficients(model) -> tuple[float, float, float]:
    """(a, b, c) for forward_flops, from a Hugging Face causal LM (sharded or not): a = 2 per weight of every
    matmul in the blocks (embeddings are lookups; the output layer is c), b = attention's two (T x T) matmuls
    per layer, c = 2 per output-layer weight. Counts every expert of a mixture of experts."""
    head = model.get_output_embeddings().weight
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | {id(head)}
    linear = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in lookups)
    c = model.config
    width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return 2.0 * linear, 4.0 * c.num_hidden_layers * width, 2.0 * head.numel()


def forward_flops(coefficients: tuple[float, float, float], rows: int, length: int, scored: int) -> float:
    """Model FLOPs of one forward over (rows, length) token slots whose output layer runs on `scored` positions.
    Attention is counted whole, as PyTorch's FlopCounterMode counts it (a causal kernel skips about half of
    it: at 1k tokens, 3% of a 1B model's FLOPs). A backward is twice its forward; recomputation (activation
    checkpointing, the fused head's logits) is not model FLOPs and is not counted."""
    a, b, c = coefficients
    return rows * length * (a + b * length) + c * scored


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA max allocated on a GPU, else host max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def host_memory_by_rank_gb(device: torch.device) -> list[float]:
    """Every rank's peak host memory so far (max RSS), in GB; a collective over a tensor on `device` (the
    training device: an nccl-only group takes no CPU tensor)."""
    rss = torch.zeros(dist.get_world_size(), device=device)
    rss[dist.get_rank()] = peak_memory_gb(torch.device("cpu"))
    dist.all_reduce(rss)
    return rss.tolist()


# Dense peak FLOP/s per GPU by name fragment, most specific first: (bf16/fp16 tensor cores, fp32), from the
# vendors' data sheets.
_PEAK_FLOPS = {"H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12), "H200": (989e12, 67e12),
               "B200": (2250e12, 80e12), "A100": (312e12, 19.5e12), "L40S": (362e12, 91.6e12),
               "A10G": (125e12, 31.2e12), "L4": (121e12, 30.3e12)}


def mfu(flops: float, seconds: float, world: int, device: torch.device, precision: str) -> dict:
    """{"mfu": a step's model FLOPs over `seconds` and all ranks' dense peak} on a GPU of known peak
    (_PEAK_FLOPS), else {}."""
    peak = device_peak_flops(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
    return {"mfu": flops / seconds / (world * peak)} if peak else {}


def device_peak_flops(name: str, precision: str) -> float | None:
    """Peak FLOP/s of the GPU called `name` (torch.cuda.get_device_name) in `precision`; None if unknown."""
    for fragment, (half, single) in _PEAK_FLOPS.items():
        if fragment in name:
            return single if precision == "fp32" else half
    return None


def say(msg: str) -> None:
    """Rank 0 prints `msg` on stderr, clearing the progress bar's line on a terminal."""
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:
        print(("\r\033[K" if sys.stderr.isatty() else "") + msg, file=sys.stderr, flush=True)


def show_progress(step: int, total: int, m: dict) -> None:
    """Rank 0's progress bar: one redrawn line on a terminal, a line every 5% when stderr is a file."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    done = int(30 * step / total)
    pairs = f"acc {m['rewards/accuracies']:.2f} margin {m['rewards/margins']:.3f} " if "rewards/margins" in m else ""
    line = (f"step {step}/{total} [{'#' * done}{'.' * (30 - done)}] loss {m['loss']:.4f} {pairs}"
            f"{m['tokens_per_s']:.0f} tok/s")
    if sys.stderr.isatty():
        print("\r" + line, end="\n" if step == total else "", file=sys.stderr, flush=True)
    elif step == total or step % max(total // 20, 1) == 0:
        print(line, file=sys.stderr, flush=True)


def open_log(path: str, resume_step: int):
    """metrics.jsonl ({"step", ...} rows), opened line-buffered for appending. A fresh run (resume_step 0)
    starts it anew; a resumed run keeps the rows up to its step and drops any logged after that checkpoint
    (they will be logged again), so one file holds the whole history once."""
    rows = []
    if resume_step and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if json.loads(line)["step"] <= resume_step]
    _write_atomic(path, lambda tmp: pathlib.Path(tmp).write_text("".join(rows)))
    return open(path, "a", buffering=1)


def plot_metrics(jsonl_path: str, png_path: str) -> bool:
    """Loss, reward accuracy and margin against step, train and eval, from metrics.jsonl into a PNG.
    Returns False, writing nothing, when matplotlib (imported here, lazily) is not installed."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or state is touched
    except ImportError:
        return False
    with open(jsonl_path) as f:
        rows = [json.loads(line) for line in f]
    fig = Figure(figsize=(15, 4), layout="tight")
    for ax, key in zip(fig.subplots(1, 3), ("loss", "rewards/accuracies", "rewards/margins")):
        for split, style in (("train", "-"), ("eval", "o-")):
            points = [(r["step"], r[key]) for r in rows if r["split"] == split and key in r]
            if points:
                ax.plot(*zip(*points), style, label=split)
        ax.set(title=key, xlabel="step")
        if ax.lines:  # SFT has no rewards to plot
            ax.legend()
    _write_atomic(png_path, lambda tmp: fig.savefig(tmp, format="png"))
    return True


def _write_atomic(path: str, write) -> None:  # a reader never sees half a file (data.write_atomic's twin)
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


class RunLog:
    """Where a run's rows go: {out_dir}/metrics.jsonl, samples.jsonl and W&B, written by rank 0 (a call on any
    other rank does nothing). A resumed run keeps the rows up to its step (see open_log)."""

    def __init__(self, out_dir: str, resume_step: int, samples: bool, wandb_project: str | None, config: dict):
        rank0 = (dist.get_rank() if dist.is_initialized() else 0) == 0
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.metrics = open_log(self.path, resume_step) if rank0 else None
        self.samples = open_log(os.path.join(out_dir, "samples.jsonl"), resume_step) if rank0 and samples else None
        self.wandb = open_wandb(wandb_project, config, out_dir) if rank0 and wandb_project else None

    def write(self, row: dict, samples: list[dict] | None = None) -> None:
        for f, rows in ((self.metrics, [row]), (self.samples, samples or [])):
            if f:  # line-buffered: each row reaches the disk as it is written
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb:
            self.wandb.log(row, samples)

    def close(self) -> None:
        """Close the files, plot metrics.png (a notice if matplotlib is missing) and finish the W&B run."""
        for f in (self.metrics, self.samples):
            if f:
                f.close()
        if self.metrics and not plot_metrics(self.path, os.path.join(os.path.dirname(self.path), "metrics.png")):
            say("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        if self.wandb:
            self.wandb.finish()


class open_wandb:
    """A Weights & Biases run that takes metrics.jsonl rows (as {split}/{metric} at the row's step) and
    samples (as a table). wandb is imported lazily; without it, a ValueError says how to install it."""

    def __init__(self, project: str, config: dict, out_dir: str):
        try:
            import wandb
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package: pip install wandb") from None
        self._wandb, self.run = wandb, wandb.init(project=project, config=config, dir=out_dir)

    def log(self, row: dict, samples: list[dict] | None = None) -> None:
        data = {f"{row['split']}/{k}": v for k, v in row.items()
                if k not in ("step", "split") and isinstance(v, (int, float))}
        if samples:
            data["samples"] = self._wandb.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
        self.run.log(data, step=row["step"])

    def finish(self) -> None:
        self.run.finish()
