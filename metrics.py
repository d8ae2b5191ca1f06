"""What a run reports: DPO pair statistics summed on device and reduced once per step, memory, MFU, the
console (rank 0 only) and metrics.jsonl.

Copyable on its own: imports only the standard library and torch.

    sums += pair_sums(out, weight)           # per micro-batch, no host sync
    dist.all_reduce(sums)                    # once per step
    row = pair_means(sums, n_pairs)          # {"loss": ..., "rewards/accuracies": ..., ...}
"""

import json
import os
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


def pair_means(sums: torch.Tensor, count: float) -> dict:
    """{metric name: sum / count} for the first len(PAIR_METRICS) entries of `sums`."""
    return {k: v / count for k, v in zip(PAIR_METRICS, sums.tolist())}


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
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)
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
    fig.savefig(png_path + ".tmp.png")
    os.replace(png_path + ".tmp.png", png_path)
    return True


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
