"""What a run reports: pair and ranking statistics, memory, MFU, the console (rank 0 only),
metrics.jsonl and W&B.

Copyable on its own: imports only the standard library and torch. This runs as written:

    import tempfile
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from metrics import RunLog, StepStats, StepSums, batch_counts, peak_memory_gb, row_sums

    cpu = torch.device("cpu")
    # A micro-batch of 2 pairs, a row each: the fields of its batches.RowBatch that these read
    # (R = 4 responses, the chosen ones first), and its loss.Losses.
    batch = SimpleNamespace(
        input_ids=torch.zeros(4, 6, dtype=torch.long, device=cpu),
        attention_mask=torch.tensor(
            [[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 3 + [0] * 3], device=cpu
        ),
        score_index=torch.arange(8, device=cpu),
        scores=torch.tensor([[1.0, 0.0], [1.0, 0.0]], device=cpu),
        response_rows=torch.tensor([0, 1, 0, 1], device=cpu),
        chosen_index=torch.tensor([0, 1], device=cpu),
        mismatched=0,
        parts=None,
    )
    out = SimpleNamespace(
        unit="pair",
        losses=torch.tensor([0.6, 0.8], device=cpu),
        chosen_rewards=torch.tensor([0.3, -0.1], device=cpu),
        rejected_rewards=torch.tensor([0.1, 0.2], device=cpu),
        chosen_logps=torch.tensor([-12.0, -9.5], device=cpu),
        rejected_logps=torch.tensor([-14.0, -9.0], device=cpu),
        response_rewards=None,
        logratios=None,
        kl=None,
    )
    coefficients = (2e6, 2048.0, 98304.0)  # flop_coefficients(model) of a Hugging Face model
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sums = StepSums(cpu)
    for _ in range(2):  # the step's micro-batches: no host sync in the loop
        sums.add(row_sums(out, batch), batch_counts(coefficients, 3, True, batch), out)
    sums.all_reduce()  # once per step
    memory = peak_memory_gb(cpu)
    stats = StepStats(
        **sums.totals(), grad_norm=1.2, skipped=False, peak_memory_gb=memory, stop_requested=False
    )
    log = RunLog(tempfile.mkdtemp(), resume_step=0, samples=False)  # log.wandb = open_wandb(...)
    # The step's row; MFU with group_peak_flops(device, "bf16") on GPUs.
    row = stats.row(step=1, lr=1e-6, seconds=0.5, peak_flops=None, elapsed=0.5)
    log.write(row)  # metrics.jsonl, and W&B
    log.close()  # and metrics.png, where matplotlib is installed
    print({k: round(row[k], 3) for k in ("loss", "rewards/accuracies", "rewards/margins")})
    print(row["tokens_per_s"], row["padding_efficiency"], row["flops"])
    dist.destroy_process_group()
"""

import importlib.util
import json
import math
import os
import pathlib
import resource
import secrets
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

PAIR_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/mean",
    "logps/chosen",
    "logps/rejected",
)


# Of a prompt's K responses: the share of rows whose highest reward is on a best-scored response,
# and Kendall's tau-b between rewards and scores.
RANK_METRICS = ("rewards/best_on_top", "rewards/kendall_tau")
# Every metric a step or an evaluation can log; "kl" is KTO's reference point, one per micro-batch.
METRICS = (*PAIR_METRICS, *RANK_METRICS, "kl")
# What row_sums adds up per row: each metric's sum, then how many values it summed.
ROW_COLUMNS = 2 * len(METRICS)


def row_sums(out, batch) -> torch.Tensor:
    """(B, ROW_COLUMNS) per row of a batches.RowBatch: for each of METRICS the sum of its values
    in the row, then for each how many values that is (absent or NaN values count none), from a
    loss.Losses `out`: its losses at their units' rows (each pair's, each row, each response's);
    its pairs' rewards, accuracies, margins and log-probs at the pairs' rows (sft alone: a row's
    best response, its only one); an unpaired loss's rewards and log-probs instead by each
    response's label; RANK_METRICS from its logratios, where it has them; its kl on the first
    row. Sum them on the device; reduce once a step."""
    rows = len(batch.scores)
    device = batch.scores.device
    every = torch.arange(rows, device=device)
    pair_rows = every if out.rejected_rewards is None else batch.response_rows[batch.chosen_index]
    responses = batch.response_rows[: len(batch.response_rows) - batch.mismatched]
    units = {"pair": pair_rows, "row": every, "response": responses}[out.unit]
    values = {"loss": (out.losses, units), "logps/chosen": (out.chosen_logps, pair_rows)}
    if out.rejected_rewards is not None:
        values.update(
            {
                "rewards/chosen": (out.chosen_rewards, pair_rows),
                "rewards/rejected": (out.rejected_rewards, pair_rows),
                "rewards/accuracies": (
                    (out.chosen_rewards > out.rejected_rewards).float(),
                    pair_rows,
                ),
                "rewards/margins": (out.chosen_rewards - out.rejected_rewards, pair_rows),
                "rewards/mean": ((out.chosen_rewards + out.rejected_rewards) / 2, pair_rows),
                "logps/rejected": (out.rejected_logps, pair_rows),
            }
        )
    if out.response_rewards is not None:
        for side, kept in (("chosen", batch.desirable), ("rejected", ~batch.desirable)):
            values[f"rewards/{side}"] = (
                torch.where(kept, out.response_rewards, math.nan),
                responses,
            )
            values[f"logps/{side}"] = (torch.where(kept, out.response_logps, math.nan), responses)
    if out.logratios is not None:
        values.update((k, (v, every)) for k, v in zip(RANK_METRICS, _ranking(out.logratios, batch)))
    if out.kl is not None:
        values["kl"] = (out.kl[None], torch.zeros(1, dtype=torch.long, device=device))
    table = torch.zeros(rows, 2, len(METRICS), device=device)
    for name, (value, where) in values.items():
        i = METRICS.index(name)
        value = value.detach().float()
        # A NaN loss stays, for the step's finiteness check; any other NaN is a value absent.
        counted = ~value.isnan() | (name == "loss")
        table[:, 0, i].index_add_(0, where, torch.where(counted, value, 0))
        table[:, 1, i].index_add_(0, where, counted.float())
    return table.view(rows, ROW_COLUMNS)


def _ranking(logratios: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) each: whether a row's highest reward is on a best-scored response (any of tied bests),
    strictly above every other response's (policy = reference: all 0, a miss, as the pair accuracy
    counts a tie), and Kendall's tau-b between rewards and scores (tau-b: scores are often tied
    grades, where tau-a cannot reach 1; 0 where undefined). 1 and 0 for a row of all-tied scores."""
    r = torch.full(batch.scores.shape, -math.inf, device=logratios.device).index_put(
        (batch.response_rows, batch.response_columns), logratios.float()
    )  # (B, K)
    valid = ~batch.scores.isnan()
    s = torch.where(valid, batch.scores, -math.inf)
    best = valid & (s == s.amax(-1, keepdim=True))
    top = r.masked_fill(~best, -math.inf).amax(-1) > r.masked_fill(best, -math.inf).amax(-1)
    both = valid[:, :, None] & valid[:, None, :]  # (B, K, K)
    ds = torch.where(both, (s[:, :, None] - s[:, None, :]).sign(), 0)
    dr = torch.where(both, (r[:, :, None] - r[:, None, :]).sign(), 0)
    # Each sum counts a pair twice, so a nonzero one is >= 2: clamp only turns 0 / 0 into 0.
    scale = (ds.abs().sum((1, 2)) * dr.abs().sum((1, 2))).sqrt().clamp(min=1)
    return top.float(), (ds * dr).sum((1, 2)) / scale


def row_means(sums: torch.Tensor) -> dict:
    """{metric: mean} from row_sums summed over rows: each of METRICS over its own values, those
    with none left out (SFT alone logs loss and logps/chosen only)."""
    totals, counts = sums.view(2, len(METRICS)).tolist()
    return {name: t / n for name, t, n in zip(METRICS, totals, counts) if n}


class StepSums:
    """One optimizer step's sums on the training device, in one tensor so that one all-reduce
    carries them: row_sums over the step's rows, then batch_counts' tokens, token slots and model
    FLOPs. Adding a micro-batch needs no host sync."""

    def __init__(self, device: torch.device):
        self._sums = torch.zeros(ROW_COLUMNS + 3, device=device)
        # The pairs' highest reward and minus their lowest, as TRL logs them: a max over ranks.
        self._extremes = torch.full((2,), -math.inf, device=device)

    def add(self, rows: torch.Tensor, counts: torch.Tensor, out) -> None:
        """A micro-batch: its row_sums, its batch_counts (3,) and its loss.Losses `out`."""
        self._sums += torch.cat([rows.sum(0), counts])
        if out.unit == "pair" and out.rejected_rewards is not None:
            rewards = torch.cat([out.chosen_rewards, out.rejected_rewards])
            self._extremes = torch.maximum(
                self._extremes, torch.stack([rewards.max(), -rewards.min()])
            )

    def all_reduce(self) -> None:
        """The sums over every rank (collectives)."""
        dist.all_reduce(self._sums)
        dist.all_reduce(self._extremes, op=dist.ReduceOp.MAX)

    def loss_is_finite(self) -> torch.Tensor:
        """() bool on the device: whether the summed loss is finite."""
        return torch.isfinite(self._sums[0])

    def totals(self) -> dict:
        """StepStats' "means" (row_means; with pairs, their rewards' max and min too), "pairs",
        "tokens", "token_slots" and "flops"."""
        tokens, slots, flops = self._sums[ROW_COLUMNS:].tolist()
        means = row_means(self._sums[:ROW_COLUMNS])
        highest, lowest = self._extremes.tolist()
        if math.isfinite(highest):
            means.update({"rewards/max": highest, "rewards/min": -lowest})
        return {
            "means": means,
            # The loss's count: its units.
            "pairs": self._sums[len(METRICS)].item(),
            "tokens": tokens,
            "token_slots": slots,
            "flops": flops,
        }


@dataclass
class StepStats:
    """One optimizer step, reduced over every rank: what train_dpo.train_step returns."""

    means: dict[str, float]
    """Each of PAIR_METRICS ("loss", "rewards/margins", ...) and RANK_METRICS: its mean over the
    global batch."""
    pairs: float
    """The global batch's loss units: pairs; rows for a listwise loss or SFT alone; responses for
    an unpaired loss (kto)."""
    tokens: float
    """Real tokens the policy ran on."""
    token_slots: float
    """Token slots of the padded batches the policy ran on."""
    flops: float
    """Model FLOPs: the policy's forwards and backward, the reference's forward."""
    grad_norm: float
    """The global gradient norm, before clipping."""
    skipped: bool
    """A rank had a non-finite loss or gradient norm (or an fp16 overflow): no rank updated."""
    peak_memory_gb: float
    """The fullest rank's peak memory so far: GPU memory allocated, or host memory on a CPU."""
    stop_requested: bool
    """A rank received a stop signal (SIGTERM, SIGUSR1, SIGINT) by the step's end."""
    loss_scale: float | None = None
    """fp16's loss scale after the step; None in other precisions."""

    def row(
        self,
        step: int,
        lr: float,
        seconds: float,
        peak_flops: float | None,
        elapsed: float,
    ) -> dict:
        """The step's metrics.jsonl row: the means, throughput over `seconds`, padding efficiency,
        memory, MFU given every rank's peak FLOP/s (group_peak_flops), and the run's `elapsed`
        seconds."""
        row = {
            "step": step,
            "split": "train",
            **self.means,
            "grad_norm": self.grad_norm,
            "lr": lr,
            "skipped": self.skipped,
            "tokens_per_s": self.tokens / seconds,
            "pairs_per_s": self.pairs / seconds,
            "padding_efficiency": self.tokens / self.token_slots,
            "flops": self.flops,
            "peak_mem_gb": self.peak_memory_gb,
            "elapsed_s": elapsed,
        }
        if peak_flops:
            row["mfu"] = self.flops / seconds / peak_flops
        if self.loss_scale is not None:
            row["loss_scale"] = self.loss_scale
        return row


def flop_coefficients(model) -> tuple[float, float, float]:
    """(a, b, c) for batch_counts from a Hugging Face causal LM (sharded or not): a = 2 per weight
    of every matmul a token runs in the blocks (of a mixture of experts, its top k experts'), b =
    attention's two (T x T) matmuls per layer, c = 2 per output-layer weight (0 for a reward
    model, whose scalar head runs on every token, counted in a)."""
    head = model.get_output_embeddings()
    heads = [] if head is None else [head.weight]
    # Embeddings are lookups, and the output layer counts apart: on the scored tokens alone.
    apart = {id(w) for w in heads} | {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    linear = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in apart)
    c = model.config
    # A mixture of experts stacks them, (experts, out, in): each token runs its top k of them.
    linear += sum(
        p.numel() // p.shape[0] * c.num_experts_per_tok for p in model.parameters() if p.dim() == 3
    )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (
        2.0 * linear,
        4.0 * c.num_hidden_layers * c.num_attention_heads * head_dim,
        2.0 * sum(w.numel() for w in heads),
    )


def batch_counts(
    coefficients: tuple[float, float, float], passes: int, reference: bool, batch
) -> torch.Tensor:
    """(3,) [tokens, token slots, model FLOPs] of a batches.RowBatch, with no sync (slots, FLOPs
    from shapes): the policy's rows run `passes` forwards' worth (3: with backward), a reference
    one; with KTO's mismatched completions (batch.parts), the models run the scored responses and
    the mismatched ones apart, the policy the mismatched ones in one forward."""
    if batch.parts:
        scored, mismatched = (_batch_flops(coefficients, part) for part in batch.parts)
        flops = (passes + reference) * scored + (1 + reference) * mismatched
    else:
        flops = (passes + reference) * _batch_flops(coefficients, batch)
    return torch.stack(
        [
            batch.attention_mask.sum().float(),
            torch.full((), float(batch.input_ids.numel()), device=batch.input_ids.device),
            torch.full((), flops, device=batch.input_ids.device),
        ]
    )


def _batch_flops(coefficients: tuple[float, float, float], batch) -> float:
    """Model FLOPs of one forward over a batches.RowBatch's (rows, length) token slots, the output
    layer on its scored tokens. Attention counts whole, as in PyTorch's FlopCounterMode (a causal
    kernel skips about half); recomputation does not count."""
    a, b, c = coefficients
    rows, length = batch.input_ids.shape
    return rows * length * (a + b * length) + c * len(batch.score_index)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    # On a CPU, peak_memory_gb's max RSS cannot be reset.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def host_memory_by_rank_gb(device: torch.device) -> list[float]:
    """Every rank's peak host memory (max RSS) in GB; a collective on `device` (nccl-only groups
    take no CPU tensor)."""
    rss = torch.zeros(dist.get_world_size(), device=device)
    rss[dist.get_rank()] = peak_memory_gb(torch.device("cpu"))
    dist.all_reduce(rss)
    return rss.tolist()


# Dense peak FLOP/s per GPU by name fragment, most specific first: (bf16/fp16 tensor cores, fp32),
# from data sheets.
_PEAK_FLOPS = {
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "H200": (989e12, 67e12),
    "B200": (2250e12, 80e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (125e12, 31.2e12),
    "L4": (121e12, 30.3e12),
}


def group_peak_flops(device: torch.device, precision: str) -> float | None:
    """Every rank's dense peak FLOP/s together in `precision`, for MFU: None on a CPU or an unknown
    GPU."""
    if device.type != "cuda":
        return None
    peak = device_peak_flops(torch.cuda.get_device_name(device), precision)
    return peak * dist.get_world_size() if peak else None


def device_peak_flops(name: str, precision: str) -> float | None:
    """One GPU's dense peak FLOP/s in `precision`, by the fragment of `name` it matches first."""
    return next(
        (
            single if precision == "fp32" else half
            for fragment, (half, single) in _PEAK_FLOPS.items()
            if fragment in name
        ),
        None,
    )


def _rank0() -> bool:
    return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"


def sharded_line(model) -> str:
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    trained_part = f" ({trained / 1e6:.2f}M trained)" if trained < total else ""
    mesh = params[0].device_mesh.shape  # (ranks,), or HSDP's (replicas, shards)
    hsdp = f" as {mesh[0]} replicas x {mesh[1]} shards (HSDP)" if len(mesh) == 2 else ""
    return (
        f"{total / 1e6:.1f}M params{trained_part}, {dist.get_world_size()} rank(s){hsdp} "
        f"on {params[0].device} ({dist.get_backend()})"
    )


def say(msg: str) -> None:
    if _rank0():
        print(("\r\033[K" if sys.stderr.isatty() else "") + msg, file=sys.stderr, flush=True)


def eval_line(step: int, n_rows: int, m: dict, samples: list[dict]) -> str:
    line = f"eval at step {step} ({n_rows} rows): loss {m['loss']:.4f}"
    if "rewards/margins" in m:
        line += f" reward accuracy {m['rewards/accuracies']:.3f} margin {m['rewards/margins']:.3f}"
    if "kl" in m:
        line += f" KL {m['kl']:.3f}"
    if "rewards/kendall_tau" in m:
        line += (
            f" best on top {m['rewards/best_on_top']:.3f} Kendall tau "
            f"{m['rewards/kendall_tau']:.3f}"
        )
    if "samples/preferred" in m:
        line += f" | demo scorer prefers {m['samples/preferred']:.0%} of samples"
    if samples:
        line += f" | {samples[0]['prompt']!r} -> {samples[0]['completion']!r}"
    return line


def show_progress(step: int, total: int, m: dict) -> None:
    """The step's progress line (rank 0), every step on a terminal, else 20 in a run; and a
    skipped step, always."""
    if m["skipped"]:
        say(f"step {step}: non-finite loss or gradient norm, step skipped on every rank")
    if not _rank0():
        return
    done = int(30 * step / total)
    pairs = (
        f"acc {m['rewards/accuracies']:.2f} margin {m['rewards/margins']:.3f} "
        if "rewards/margins" in m
        else ""
    )
    line = (
        f"step {step}/{total} [{'#' * done}{'.' * (30 - done)}] loss {m['loss']:.4f} "
        f"{pairs}{m['tokens_per_s']:.0f} tok/s"
    )
    if sys.stderr.isatty():
        print("\r" + line, end="\n" if step == total else "", file=sys.stderr, flush=True)
    elif step == total or step % max(total // 20, 1) == 0:
        print(line, file=sys.stderr, flush=True)


def open_log(path: str, resume_step: int):
    """A JSON Lines file of {"step", ...} rows, line-buffered for appending. A resumed run keeps the
    rows up to its step and cuts later ones (logged again) in one truncate: an interruption leaves
    the old file or the kept rows."""
    f = open(path, "a+" if resume_step else "w+", buffering=1)
    f.seek(0)
    keep = 0
    for line in iter(f.readline, ""):
        if json.loads(line)["step"] > resume_step:
            break
        keep = f.tell()
    f.truncate(keep)
    return f


def plot_metrics(jsonl_path: str, png_path: str) -> bool:
    """Loss, reward accuracy, margin and the rewards' Kendall tau with the scores by step,
    metrics.jsonl into a PNG; False (none written) without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or state is touched
    except ImportError:
        return False
    rows = [json.loads(line) for line in pathlib.Path(jsonl_path).read_text().splitlines()]
    fig = Figure(figsize=(20, 4))  # fixed margins: a layout engine would draw the figure twice
    fig.subplots_adjust(left=0.055, right=0.98, bottom=0.12, top=0.93, wspace=0.2)
    keys = ("loss", "rewards/accuracies", "rewards/margins", "rewards/kendall_tau")
    for ax, key in zip(fig.subplots(1, len(keys)), keys):
        for split, style in (("train", "-"), ("eval", "o-")):
            points = [(r["step"], r[key]) for r in rows if r["split"] == split and key in r]
            if points:
                ax.plot(*zip(*points), style, label=split)
        ax.set(title=key, xlabel="step")
        if ax.lines:  # SFT has no rewards to plot
            ax.legend()
    fig.savefig(png_path, format="png")
    return True


class RunLog:
    """A run's rows into {out_dir}/metrics.jsonl, samples.jsonl and W&B by rank 0 (elsewhere calls
    do nothing)."""

    def __init__(self, out_dir: str, resume_step: int, samples: bool):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.metrics = open_log(self.path, resume_step) if _rank0() else None
        self.samples = (
            open_log(os.path.join(out_dir, "samples.jsonl"), resume_step)
            if _rank0() and samples
            else None
        )
        # An open_wandb run on rank 0, opened by the caller, where a failure reaches every rank.
        self.wandb = None

    def write_data(self, summaries: dict[str, dict], fresh: bool, pairs: str = "all") -> None:
        """Show each data split's counts (data.tokenize_rows' summary), with the pairs its rows give
        under --pairs `pairs`; a fresh run also logs them at step 0."""
        for split, summary in summaries.items():
            d = {k: v for k, v in summary.items() if not isinstance(v, dict)} | {
                "pairs": summary["pairs"][pairs]
            }
            if fresh:
                self.write({"step": 0, "split": f"data/{split}", **d})
            if d["rows"] or d["dropped"]:
                say(
                    f"{split} data: {d['rows']} rows of {d['responses']} responses, {d['pairs']} "
                    f"pairs (--pairs {pairs}); dropped "
                    f"{d['dropped']} (unscored {d['dropped_unscored']}, tied {d['dropped_tied']}, "
                    f"empty response {d['dropped_empty']}, identical {d['dropped_identical']}, of "
                    f"which after truncation {d['identical_after_truncation']}); truncated "
                    f"{d['truncated']} (prompts {d['truncated_prompts']}, responses "
                    f"{d['truncated_responses']})"
                )
            elif split == "eval":
                say("no --eval-data or --eval-fraction: evaluation skipped")

    def write(self, row: dict, samples: list[dict] | None = None) -> None:
        for f, rows in ((self.metrics, [row]), (self.samples, samples or [])):
            if f:  # line-buffered: each row reaches the disk as it is written
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb:
            # As {split}/{metric} at the row's step, the samples as a table.
            data = {
                f"{row['split']}/{k}": v
                for k, v in row.items()
                if k not in ("step", "split") and isinstance(v, (int, float))
            }
            if samples:
                import wandb

                data["samples"] = wandb.Table(
                    columns=list(samples[0]), data=[list(s.values()) for s in samples]
                )
            self.wandb.log(data, step=row["step"])

    def close(self) -> None:
        for f in (self.metrics, self.samples):
            if f:
                f.close()
        if self.metrics and not plot_metrics(
            self.path, os.path.join(os.path.dirname(self.path), "metrics.png")
        ):
            say("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        if self.wandb:
            self.wandb.finish()


@dataclass
class WandbConfig:
    wandb_project: str | None = None
    """Also log metrics and samples to this Weights & Biases project (needs the wandb package); a
    run resumed in the same --out-dir logs on into the same W&B run. Default: none."""
    wandb_run_name: str | None = None
    """The W&B run's name (TRL's run_name); default: W&B's own."""

    def __post_init__(self):
        # The one check for wandb, which is imported lazily: before any work.
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package: pip install wandb")


def open_wandb(config: WandbConfig, run_config: dict, out_dir: str, resume: bool):
    """A W&B run, for RunLog.wandb; wandb is imported lazily. Its id is kept in
    {out_dir}/wandb_run_id, so that a resumed run (resume=True) continues it."""
    import wandb

    id_file = pathlib.Path(out_dir, "wandb_run_id")
    if not (resume and id_file.exists()):
        id_file.write_text(secrets.token_hex(8))
    return wandb.init(
        project=config.wandb_project,
        name=config.wandb_run_name,
        config=run_config,
        dir=out_dir,
        id=id_file.read_text(),
        resume="allow",
    )
