"""The memory plan against real training steps on this CPU, with the GPU's paths: the output
layer fused into the loss (logps.fused_head), SDPA's kernels where the CPU has them. Each grid
point trains 4 steps of a run (its rows all of one shape, so that every micro-batch is the
longest) and measures on each rank, two ways:
- the third step's peak of live tensor bytes with torch's FSDPMemTracker: weights, gradients,
  optimizer state, activations and FSDP2's buffers (the reference's shards, which it does not see,
  added). It sees tensors at the dispatcher, as the plan does;
- the fourth step at the allocator, with memray: the peak of the live bytes that every malloc made
  during the step (so also the buffers that kernels make for themselves inside one op, which a GPU's
  caching allocator counts too), above what lived before it (the tensors a step keeps: shards and
  AdamW's moments, counted from the run's own tensors). heap_gb is their sum.
The plan (train_dpo.py --plan, the same flags) gives its peak for the run's micro-batch size, and
its transient (the peak less what a step keeps), against the heap's. Prints a line per point and, at
the end, the errors' spread and how often the plan and the heap pick the same largest micro-batch
size under a budget (same_choice).

    pip install memray  # this bench alone
    python bench/plan_check.py [RANKS] [FILTER]  # from the repo root; RANKS 1 (default) or 2, 4

RANKS > 1 starts itself under torchrun (gloo); FILTER keeps the points whose name contains it.
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, ".")
import torch  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fsdp_setup  # noqa: E402
import logps  # noqa: E402
import memory  # noqa: E402
import train_dpo  # noqa: E402

OUT = os.path.join(tempfile.gettempdir(), "plan_check")
MODELS = {  # hidden, intermediate, layers, heads, kv heads, vocabulary: random Llamas, byte tokens
    "tiny": None,
    "small": (256, 768, 4, 8, 4, 2048),
    # Its output layer a real share of memory, as in the GPU's models: 52M parameters, a third of
    # them in the (tied) embedding.
    "vocab32k": (512, 1376, 8, 8, 8, 32000),
}
QWEN_MOE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=384,
    max_position_embeddings=4096,
)

# Other architectures the trainer trains, as small: name -> (transformers config class, its args).
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, vocab_size=384)
ARCHITECTURES = {
    "qwen3": (
        "Qwen3Config",
        SMALL | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    # Eager attention (its logits are soft-capped), sliding windows on every other layer.
    "gemma2": (
        "Gemma2Config",
        SMALL | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        SMALL | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    "gpt_neox": ("GPTNeoXConfig", SMALL | dict(num_attention_heads=4)),
    "gpt2": ("GPT2Config", dict(n_embd=128, n_layer=3, n_head=4, vocab_size=384)),
}


def make_model(name: str) -> str:
    """A folder holding model `name`'s config and the byte tokenizer (the plan needs no weights;
    the run draws them from --seed as for tiny: models.open_weights)."""
    import transformers

    folder = os.path.join(OUT, "models", name)
    if name == "tiny" or os.path.isdir(folder):
        return name if name == "tiny" else folder
    if name == "moe":
        config = transformers.Qwen3MoeConfig(**QWEN_MOE)
    elif name in ARCHITECTURES:
        config = getattr(transformers, ARCHITECTURES[name][0])(**ARCHITECTURES[name][1])
    else:
        hidden, inter, layers, heads, kv, vocab = MODELS[name]
        config = transformers.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            max_position_embeddings=4096,
        )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    return folder


def make_data(length: int, k: int) -> str:
    """64 rows of a prompt of length // 2 byte-tokens and k responses that fill `length` with their
    EOS, scored k, ..., 1 (k = 2: a pair file)."""
    path = os.path.join(OUT, f"rows-{length}-{k}.jsonl")
    prompt, response = length // 2, length - length // 2 - 1
    with open(path, "w") as f:
        for i in range(64):
            texts = [(chr(97 + (i + j) % 26) * response) for j in range(k)]
            row = {"prompt": "p" * prompt, "chosen": texts[0], "rejected": texts[1]}
            if k > 2:
                row = {"prompt": "p" * prompt, "responses": texts, "scores": list(range(k, 0, -1))}
            f.write(json.dumps(row) + "\n")
    return path


# name -> (model, length, K, micro-batch, flags)
BASE = ("small", 256, 2, 2, ())
POINTS = {
    "base": BASE,
    "tiny": ("tiny", 256, 2, 2, ()),
    "moe": ("moe", 256, 2, 2, ("--precision", "bf16")),
    "micro1": ("small", 256, 2, 1, ()),
    "micro4": ("small", 256, 2, 4, ()),
    "micro8": ("small", 256, 2, 8, ()),
    "len128": ("small", 128, 2, 2, ()),
    "len512": ("small", 512, 2, 2, ()),
    "len1024": ("small", 1024, 2, 1, ()),
    "k4-shared": ("small", 256, 4, 2, ()),
    "k4-separate": ("small", 256, 4, 2, ("--no-share-prompt",)),
    "separate": ("small", 256, 2, 2, ("--no-share-prompt",)),
    "separate-micro1": ("small", 256, 2, 1, ("--no-share-prompt",)),
    "separate-micro4": ("small", 256, 2, 4, ("--no-share-prompt",)),
    "checkpointing": ("small", 256, 2, 2, ("--activation-checkpointing",)),
    "checkpointing-micro1": ("small", 256, 2, 1, ("--activation-checkpointing",)),
    "checkpointing-micro4": ("small", 512, 2, 4, ("--activation-checkpointing",)),
    "lora": ("small", 256, 2, 2, ("--lora-rank", "8")),
    "precompute": ("small", 256, 2, 2, ("--ref", "precompute")),
    "bf16": ("small", 256, 2, 2, ("--precision", "bf16")),
    "bf16-micro4": ("small", 512, 2, 4, ("--precision", "bf16")),
    "simpo": ("small", 256, 2, 2, ("--loss", "simpo")),
    # Packed rows (--packing), micro-batches of --micro-batch-tokens holding `micro` rows: a shared
    # row of length 256 is 384 tokens, a pair in separate rows 512.
    "packed": ("small", 256, 2, 2, ("--packing", "--micro-batch-tokens", "768")),
    "packed-micro4": ("small", 256, 2, 4, ("--packing", "--micro-batch-tokens", "1536")),
    "packed-separate": (
        "small",
        256,
        2,
        2,
        ("--packing", "--no-share-prompt", "--micro-batch-tokens", "1024"),
    ),
    "packed-k4": ("small", 256, 4, 2, ("--packing", "--micro-batch-tokens", "1280")),
    "vocab32k": ("vocab32k", 512, 2, 4, ()),
    "vocab32k-bf16": ("vocab32k", 512, 2, 4, ("--precision", "bf16")),
    "vocab32k-checkpointing": ("vocab32k", 512, 2, 4, ("--activation-checkpointing",)),
    **{name: (name, 256, 2, 2, ()) for name in ARCHITECTURES},
}


def flags(point, ranks: int, out: str) -> list[str]:
    model, length, k, micro, extra = point
    batch = 2 * micro * ranks
    return [
        *("--model", make_model(model), "--data", make_data(length, k), "--no-warm-start"),
        *("--max-length", str(length), "--batch-size", str(batch)),
        *("--micro-batch-size", str(micro), "--device", "cpu", "--num-samples", "0"),
        *("--no-eval-before", "--eval-every", "0", "--out-dir", out, "--cache-dir", OUT + "/cache"),
        *("--warmup-steps", "0", "--lr", "1e-4"),
        *extra,
    ]


def measure(argv: list[str]) -> tuple[float, float, float]:
    """GB, on this rank, the output layer fused: the third step's peak of live tensor bytes
    (FSDPMemTracker), the fourth step's peak at the allocator above what lived before it (memray),
    and what lived before it (the run's shards and optimizer state)."""
    try:
        import memray
    except ImportError:
        sys.exit("bench/plan_check.py measures at the allocator with memray: pip install memray")
    real_step = train_dpo.train_step
    real_logps = logps.response_logps
    peaks = []
    tracking = []

    def step(run, optimizer, *args):
        if len(peaks) < 2:
            peaks.append(0.0)
            return real_step(run, optimizer, *args)
        if len(peaks) == 3:
            path = os.path.join(OUT, f"heap-{os.environ.get('RANK', 0)}.bin")
            if os.path.exists(path):
                os.remove(path)
            with memray.Tracker(path):
                stats = real_step(run, optimizer, *args)
            peaks.append(memray.FileReader(path).metadata.peak_memory / memory.GB)
            peaks.append(kept_bytes(run, optimizer) / memory.GB)
            return stats
        tracker = FSDPMemTracker(run.policy, optimizer)
        if run.reference is not None and run.reference is not run.policy:
            tracker.track_external(run.reference)
        tracking.append(tracker)
        with tracker:
            stats = real_step(run, optimizer, *args)
        peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        # The tracker counts no DTensor shards of an external module: the reference's, added here
        # (none of LoRA's, whose reference is the policy's base).
        policy = {p.to_local().untyped_storage()._cdata for p in run.policy.parameters()}
        for param in run.reference.parameters() if run.reference is not None else ():
            storage = param.to_local().untyped_storage()
            peak += storage.nbytes() * (storage._cdata not in policy)
        peaks.append(peak / memory.GB)
        return stats

    def response_logps(*args):
        # The tracker's per-module records take one forward per module (LoRA's reference is the
        # policy's); its peak is kept.
        if tracking:
            tracking[-1].reset_mod_stats()
        return real_logps(*args)

    train_dpo.train_step = step
    logps.response_logps = response_logps
    try:
        with logps.fused_head():
            train_dpo.main([*argv, "--max-steps", "4"])
    finally:
        train_dpo.train_step = real_step
        logps.response_logps = real_logps
    return peaks[2], peaks[3], peaks[4]


def kept_bytes(run, optimizer) -> int:
    """Bytes of the tensors that live between steps on this rank: the policy's and the reference's
    shards, once each, and the optimizer's state."""
    storages = {}
    for model in (run.policy, run.reference):
        for param in model.parameters() if model is not None else ():
            storage = param.to_local().untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    for state in optimizer.state.values():
        for value in state.values():
            # AdamW's moments are DTensors, like the weights: this rank's shard.
            local = value.to_local() if isinstance(value, DTensor) else value
            storage = local.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def planned(argv: list[str], ranks: int) -> tuple[float, float]:
    """GB: the plan's peak for the run's micro-batch size, and its transient (less what a step
    keeps: shards and AdamW's moments)."""
    real = memory.plan_memory
    plans = []

    def keep(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    memory.plan_memory = keep
    try:
        train_dpo.main([*argv, "--plan", "--plan-gpus", str(ranks)])
    finally:
        memory.plan_memory = real
    size = int(argv[argv.index("--micro-batch-size") + 1])
    parts = plans[-1].parts[size]
    kept = sum(gb for part, gb in parts.items() if part in KEPT)
    return plans[-1].peaks[size], plans[-1].peaks[size] - kept


# The plan's parts that live between steps.
KEPT = ("weights trained (float32 masters)", "frozen weights", "reference", memory.MOMENTS)


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    wanted = sys.argv[2] if len(sys.argv) > 2 else ""
    names = [n for n in POINTS if wanted in n]
    if ranks > 1 and "RANK" not in os.environ:
        for name in names:
            make_model(POINTS[name][0])
            make_data(POINTS[name][1], POINTS[name][2])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={ranks}", __file__, str(ranks), wanted]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return
    torch.set_num_threads(1 if ranks > 1 else torch.get_num_threads())
    rank = int(os.environ.get("RANK", 0))
    errors = []
    transients = []
    # (model, length, K, flags) -> {micro-batch: (plan, measured)}: the points of one run's
    # settings at several micro-batch sizes, for the choice of the largest that fits.
    families = {}
    for name in names:
        out = os.path.join(OUT, f"run-{name}-{ranks}")
        argv = flags(POINTS[name], ranks, out)
        got = torch.tensor(measure(argv))
        rows = [got]
        if ranks > 1:
            import torch.distributed as dist

            # A group of its own keys in torchrun's store, as every run's (fsdp_setup).
            fsdp_setup.init_distributed("cpu")
            rows = [torch.zeros(3) for _ in range(ranks)]
            dist.all_gather(rows, got)
            dist.destroy_process_group()
        # Every rank plans, as every rank trains: their calls to fsdp_setup.on_rank0 stay in step.
        plan, transient = planned(argv, ranks)
        if rank == 0:
            # The fullest rank's: by the tracker, and by the heap (what it kept, and its step's).
            worst = max(float(r[0]) for r in rows)
            fullest = max(rows, key=lambda r: float(r[1] + r[2]))
            heap, heap_transient = float(fullest[1] + fullest[2]), float(fullest[1])
            errors.append((plan - heap) / heap)
            transients.append((transient - heap_transient) / heap_transient)
            model, length, k, micro, extra = POINTS[name]
            families.setdefault((model, length, k, extra), {})[micro] = (plan, heap)
            line = {"point": name, "ranks": ranks, "plan_gb": round(plan, 4)}
            line |= {
                "tracker_gb": round(worst, 4),
                "tracker_error": round((plan - worst) / worst, 4),
            }
            line |= {"heap_gb": round(heap, 4), "error": round(errors[-1], 4)}
            line |= {"plan_transient_gb": round(transient, 4)}
            line |= {"heap_transient_gb": round(heap_transient, 4)}
            line |= {"transient_error": round(transients[-1], 4)}
            print(json.dumps(line), flush=True)
    if rank == 0 and errors:
        errors.sort()
        transients.sort()
        print(
            json.dumps(
                {
                    "points": len(errors),
                    "median_abs_error": sorted(abs(e) for e in errors)[len(errors) // 2],
                    "min_error": errors[0],
                    "max_error": errors[-1],
                    "min_transient_error": transients[0],
                    "max_transient_error": transients[-1],
                    "same_largest_fitting": same_choice(families),
                }
            )
        )


def same_choice(families: dict) -> float:
    """The share of budgets at which the plan's largest fitting micro-batch size (peak at most the
    budget) is the measured one: for each family of points at 2 or more sizes, 100 budgets evenly
    from half its smallest measured peak to 1.5 times its largest."""
    same = []
    for peaks in families.values():
        if len(peaks) < 2:
            continue
        low = min(m for _, m in peaks.values()) / 2
        high = max(m for _, m in peaks.values()) * 1.5
        for i in range(100):
            budget = low + (high - low) * i / 99
            chosen = [max([s for s in peaks if peaks[s][j] <= budget], default=0) for j in (0, 1)]
            same.append(chosen[0] == chosen[1])
    # None where no family has two sizes (each packed point its own --micro-batch-tokens).
    return sum(same) / len(same) if same else None


if __name__ == "__main__":
    main()
