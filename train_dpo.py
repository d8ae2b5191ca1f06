"""DPO training with FSDP2 mixed precision, one code path for 1..N ranks. Reads top to bottom: the
config; the loop, with the DPO step written out; what it calls (setup, models, evaluation,
checkpoints, export).

    python train_dpo.py  # tiny model, built-in demo data, CPU is fine
    torchrun --nproc_per_node=8 train_dpo.py --precision bf16 --model <hub id or dir> \
        --data prefs.jsonl
"""

import functools
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Literal

import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
import tyro

from batches import BatchConfig, StepBatches, micro_batches, pair_table, rank_share, table_rows
from checkpoint import (
    CheckpointConfig,
    StopRequest,
    check_same_run,
    find_checkpoint,
    finish_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from data import (
    DataConfig,
    PairTokens,
    key_digest,
    load_tokenizer,
    load_tokens,
    tokenize_to_cache,
    write_atomic,
    write_jsonl,
)
from demo import demo_config, score_samples
from fsdp_setup import (
    FSDPConfig,
    build_sharded,
    exit_without_shutdown,
    find_block_class,
    full_tensors,
    inference,
    init_distributed,
    mix_into,
    on_rank0,
    save_files,
)
from lora import (
    LoraConfig,
    WithoutAdapters,
    add_adapters,
    check_mergeable,
    initial_weights,
    merged_entries,
    save_adapters,
)
from loss import LossConfig, ScoredHead, add_scored_head, pair_logps, pair_loss, response_logps
from metrics import (
    PAIR_METRICS,
    RunLog,
    batch_counts,
    eval_line,
    flop_coefficients,
    host_memory_by_rank_gb,
    open_wandb,
    pair_means,
    pair_stats,
    peak_memory_gb,
    say,
    sharded_line,
    show_progress,
    step_metrics,
)
from models import (
    build_model,
    find_weights,
    load_model_config,
    model_identity,
    open_weights,
    save_pretrained,
)
from precision import Precision, PrecisionConfig, resolve_precision, skip_counts
from samples import SampleConfig, sample_completions

_CONFIGS = (
    tyro.conf.OmitArgPrefixes
)  # every sub-config's flags are top-level: --beta, not --objective.beta


# ------------------------------------------------------------------------------------------- config
@dataclass
class Config:
    model: str = "tiny"
    """Hub id, local folder, or "tiny" (random-init Llama, byte tokenizer, no download); also the
    reference."""
    dataset: Annotated[DataConfig, _CONFIGS] = field(default_factory=DataConfig)
    batching: Annotated[BatchConfig, _CONFIGS] = field(default_factory=BatchConfig)
    objective: Annotated[LossConfig, _CONFIGS] = field(default_factory=LossConfig)
    mixed_precision: Annotated[PrecisionConfig, _CONFIGS] = field(default_factory=PrecisionConfig)
    fsdp: Annotated[FSDPConfig, _CONFIGS] = field(default_factory=FSDPConfig)
    lora: Annotated[LoraConfig, _CONFIGS] = field(default_factory=LoraConfig)
    sampling: Annotated[SampleConfig, _CONFIGS] = field(default_factory=SampleConfig)
    checkpoints: Annotated[CheckpointConfig, _CONFIGS] = field(default_factory=CheckpointConfig)
    lr: float | None = None
    """Peak learning rate. Default: 1e-3 for tiny (from scratch), 5e-7 (DPO paper), 5e-6 with
    --lora-rank (TRL)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps, then cosine decay to a tenth of --lr at the last step."""
    out_dir: str = "runs/dpo"
    """Where metrics.jsonl, checkpoints/ and final/ (the Hugging Face export) go."""
    wandb_project: str | None = None
    """Also log metrics and samples to this Weights & Biases project (needs the wandb package)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Hugging Face export in {out_dir}/final; float32 is the master weights as
    trained."""
    seed: int = 0
    """Seeds the tiny model's init and the data order."""
    dropout: bool = False
    """Keep the model's dropout on in the policy. Off (as in TRL): it makes the log-ratios noisy
    from step 1."""

    def __post_init__(self):
        if self.lr is None and self.model == "tiny":  # trained from scratch
            self.lr = 1e-3
        elif self.lr is None:  # the DPO paper's; with LoRA, TRL's LoRA DPO example's
            self.lr = 5e-6 if self.lora.lora_rank else 5e-7
        self.objective = replace(
            self.objective, loss=self.objective.losses, loss_weights=self.objective.weights
        )
        if min(self.warmup_steps, self.weight_decay) < 0:
            raise ValueError("--warmup-steps and --weight-decay must be >= 0")
        if (
            self.wandb_project and importlib.util.find_spec("wandb") is None
        ):  # the one check; imported lazily
            raise ValueError("--wandb-project needs the wandb package: pip install wandb")
        if self.lora.lora_rank and self.objective.sync_ref_model:
            raise ValueError(
                "--sync-ref-model: with --lora-rank the reference is the base model, which never "
                "changes"
            )
        if (
            self.lora.lora_dropout and not self.dropout
        ):  # the policy trains in eval mode without --dropout
            raise ValueError(
                "--lora-dropout needs --dropout: dropout runs only in train mode, which --dropout "
                "turns on (the model's own dropout too, where its config has any)"
            )


# Resuming with any of these changed is refused; all else may change (--max-steps, --lr, precision,
# ...).
_OBJECTIVE = [
    f.name for f in fields(LossConfig) if f.name != "ref"
]  # every option of the loss (not --ref's mode)
_SAME_RUN = {
    name: "--" + name.replace("_", "-")
    for name in (
        "model",
        "data",
        "seed",
        "eval_fraction",
        "batch_size",
        "max_length",
        "max_prompt_length",
        "truncation",
        "group_by_length",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
        *_OBJECTIVE,
    )
}
_SAME_RUN["data_sha256"] = "the tokenized --data (its content, cut by this code)"


# ----------------------------------------------------------------------------------------- the loop
def train(cfg: Config, rank: int, world: int, device: torch.device) -> int:
    """Everything that needs the process group. Returns the exit code."""
    try:
        run, optimizer = setup(cfg, world, device)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    cfg, objective, micro_size = (
        run.cfg,
        run.cfg.objective,
        run.cfg.batching.micro_batch_size,
    )  # resolved
    policy, scaler = (
        run.policy,
        run.precision.scaler,
    )  # scaler: fp16's; elsewhere it passes all through
    log = RunLog(
        cfg.out_dir, run.start_step, cfg.sampling.num_samples > 0 and len(run.eval) > 0
    )  # and samples.jsonl
    if (
        cfg.wandb_project
    ):  # rank 0's run; its failure (no API key on a batch node) stops every rank at once
        log.wandb = on_rank0(
            functools.partial(open_wandb, cfg.wandb_project, asdict(cfg), cfg.out_dir), share=False
        )
    log.write_data(
        {split: run.data[split] for split in ("train", "eval")}, fresh=run.start_step == 0
    )
    # Tokens, token slots and model FLOPs (LoRA's backward makes no frozen-weight gradient: one
    # forward's worth).
    counts = functools.partial(
        batch_counts,
        flop_coefficients(policy),
        objective.pairwise,
        2 if cfg.lora.lora_rank else 3,
        run.reference is not None,
    )
    stop = StopRequest()  # SIGTERM / SIGUSR1 / SIGINT: finish the step, save, exit
    t0 = time.perf_counter()
    bad_steps = 0  # consecutive skipped steps that count toward --max-skipped-steps
    if run.start_step == 0 and cfg.sampling.eval_before:
        evaluate_and_sample(run, log, 0, t0)  # the baseline: where the samples and the curves start
    for step in range(run.start_step, run.steps.total_steps):
        lr = get_lr(step, cfg.lr, cfg.warmup_steps, run.steps.total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_t0 = time.perf_counter()
        batch = run.steps(step)  # the global batch: pair indices
        mine = rank_share(batch, rank, world)
        tokens_per_pair = (
            run.train.mean_chosen(batch) if "sft" in objective.losses else None
        )  # sft: a global mean
        sums = torch.zeros(
            len(PAIR_METRICS) + 3, device=device
        )  # pair metrics; tokens, token slots, FLOPs
        for i, (idx, micro) in enumerate(
            micro_batches(run.train, mine, micro_size, run.pad_id, device)
        ):
            # By default each micro-batch's gradient is reduce-scattered at once, so no rank holds a
            # full one.
            last = (i + 1) * micro_size >= len(mine)
            policy.set_requires_gradient_sync(last or not cfg.fsdp.unsharded_grad_accumulation)
            ref_logps = (
                table_rows(run.ref_tables["train"], idx) if run.ref_tables else None
            )  # --ref precompute
            logps, ref_logps, wpo = pair_logps(
                policy, run.reference, micro, objective, ref_logps
            )  # (2B,) each
            out = pair_loss(
                logps, ref_logps, micro.response_lengths, objective, tokens_per_pair, wpo
            )  # (B,) each
            loss = out["losses"].sum() / len(
                mine
            )  # FSDP averages over ranks: the mean over the global batch
            scaler.scale(loss).backward()
            sums += torch.cat([pair_stats(out).sum(0), counts(micro)])
        dist.all_reduce(sums)  # one collective per step for the metrics; one more for the maxima:
        peaks = torch.tensor([peak_memory_gb(device), float(stop.signum > 0)], device=device)
        dist.all_reduce(
            peaks, op=dist.ReduceOp.MAX
        )  # the fullest rank's memory; whether any rank must stop
        scaler.unscale_(optimizer)  # fp16: clip the true gradients
        norm = torch.nn.utils.clip_grad_norm_(
            policy.parameters(), cfg.mixed_precision.max_grad_norm or math.inf
        )
        grad_norm = (
            norm.full_tensor() if isinstance(norm, DTensor) else norm
        )  # over every rank's shards
        # A global norm and loss: a NaN, or an fp16 overflow, on any rank skips the step on all of
        # them.
        skipped = not bool(torch.isfinite(grad_norm) & torch.isfinite(sums[0]))
        if not skipped:
            scaler.step(optimizer)
        # fp16: an overflow on any rank lowers the scale on all (found_inf is reduced over shards)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if objective.sync_ref_model and (step + 1) % objective.ref_model_sync_steps == 0:  # TR-DPO
            mix_into(run.reference, policy, objective.ref_model_mixup_alpha)
        metrics = step_metrics(
            sums,
            peaks,
            time.perf_counter() - step_t0,
            cfg.batching.batch_size,
            objective.pairwise,
            world,
            device,
            run.precision.name,
        )
        row = {
            "step": step + 1,
            "split": "train",
            **metrics,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "skipped": skipped,
            "elapsed_s": time.perf_counter() - t0,
        }
        if scaler.is_enabled():
            row["loss_scale"] = scaler.get_scale()
        log.write(row)
        show_progress(step + 1, run.steps.total_steps, row)
        bad_steps = bad_steps + skip_counts(scaler, row["loss"]) if skipped else 0
        if skipped:
            say(f"step {step + 1}: non-finite loss or gradient norm, step skipped on every rank")
        if bad_steps >= cfg.mixed_precision.max_skipped_steps:
            say(
                f"error: stopping at step {step + 1}: {bad_steps} consecutive steps since step "
                f"{step + 2 - bad_steps} had a non-finite loss or gradient norm"
            )
            finish_checkpoint()
            log.close()
            return 1
        if (
            cfg.sampling.eval_every
            and (step + 1) % cfg.sampling.eval_every == 0
            and step + 1 < run.steps.total_steps
        ):
            evaluate_and_sample(run, log, step + 1, t0)
        stopping = peaks[1].item() > 0
        if stopping or (
            cfg.checkpoints.save_every and (step + 1) % cfg.checkpoints.save_every == 0
        ):
            path = save(run, optimizer, step + 1)
        finish_checkpoint(
            wait=stopping
        )  # an --async-save written by now moves `latest`; stopping: wait for it
        if stopping:
            say(
                f"stopped by a signal after step {step + 1}: saved {path}; continue with --resume "
                "latest"
            )
            log.close()  # and the W&B run finished: the process leaves without interpreter shutdown
            return stop.exit_code
    stop.restore()
    finish_checkpoint()
    evaluate_and_sample(run, log, run.steps.total_steps, t0)
    export_final(run, log)
    return 0


def get_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """1) linear warmup to peak over `warmup` steps; 2) cosine decay to peak/10 at the last step."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(total - 1 - warmup, 1)
    return peak / 10 + (peak - peak / 10) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def evaluate_and_sample(run, log: RunLog, step: int, t0: float) -> None:
    """Means over the held-out set, completions of its first --num-samples prompts; both logged, a
    line shown."""
    if not len(run.eval):
        return
    objective, micro, sampling = (
        run.cfg.objective,
        run.cfg.batching.micro_batch_size,
        run.cfg.sampling,
    )

    def stats(idx, batch):  # (B, len(PAIR_METRICS))
        ref_logps = table_rows(run.ref_tables["eval"], idx) if run.ref_tables else None
        logps, ref_logps, wpo = pair_logps(run.policy, run.reference, batch, objective, ref_logps)
        return pair_stats(
            pair_loss(
                logps, ref_logps, batch.response_lengths, objective, run.eval.mean_chosen(), wpo
            )
        )

    with inference(run.policy):  # every rank generates (FSDP needs them all); rank 0 writes
        table = pair_table(run.eval, len(PAIR_METRICS), stats, micro, run.pad_id, run.device)
        prompts = [run.eval[i]["prompt"] for i in range(min(sampling.num_samples, len(run.eval)))]
        samples = [
            {"step": step, **s}
            for s in sample_completions(
                run.policy, run.tokenizer, prompts, sampling, run.pad_id, run.cfg.seed, run.device
            )
        ]
    m = pair_means(table.sum(0), len(run.eval), objective.pairwise)
    if (
        run.demo and samples
    ):  # the demo's ground truth: the share of samples in the chosen (or rejected) style
        m.update(score_samples([s["completion"] for s in samples]))
    log.write({"step": step, "split": "eval", **m, "elapsed_s": time.perf_counter() - t0}, samples)
    say(eval_line(step, len(run.eval), m, samples))


# -------------------------------------------------------------------------------------------- setup
@dataclass
class Run:
    """What setup decides and builds, once. cfg is a resolved copy (the micro-batch size)."""

    cfg: Config
    device: torch.device
    precision: Precision
    tokenizer: transformers.PreTrainedTokenizerBase
    train: PairTokens
    eval: PairTokens
    data: dict  # the tokenized data's summary: fingerprint, sha256, counts
    demo: bool  # the built-in demo, whose samples have a ground-truth scorer
    steps: StepBatches  # each step's global batch
    start_step: int
    pad_id: int  # any id does: padding is never attended to nor scored
    policy: torch.nn.Module
    reference: (
        torch.nn.Module | None
    )  # None with --ref precompute or no reference; LoRA: the policy's base
    ref_tables: dict = field(
        default_factory=dict
    )  # --ref precompute: (N, 2) [chosen, rejected] "train", "eval"


def setup(cfg: Config, world: int, device: torch.device) -> tuple[Run, torch.optim.Optimizer]:
    """Resolve the config; read the data (rank 0 tokenizes) and the resume state; build the policy
    and (online) a frozen reference, sharded alike, from weights rank 0 alone loads (LoRA: the
    reference is the base, adapters off), or precompute its log-probs; then AdamW over the float32
    master weights that train, as saved when resuming. Raises ValueError, naming the flag or the
    file, for anything the user must fix."""
    cfg = replace(cfg, batching=cfg.batching.resolve(world))
    precision = resolve_precision(cfg.mixed_precision, device)
    if precision.warning:
        say(f"warning: {precision.warning}")
    tokenizer = load_tokenizer(cfg.model)
    model_config = load_model_config(cfg.model, tokenizer, cfg.dataset.max_length)
    probe = prepare_model(
        cfg, build_model(model_config)
    )  # a bad --lora-targets fails here, before any weights
    if cfg.lora.export_merged:
        check_mergeable(probe)
    data_cfg, demo = on_rank0(
        functools.partial(demo_config, cfg.dataset, write_jsonl)
    )  # the demo's files: as any data
    train, evals, data = load_tokens(
        on_rank0(functools.partial(tokenize_to_cache, data_cfg, tokenizer, say))
    )
    steps = StepBatches(
        train.lengths, cfg.batching, cfg.seed
    )  # refuses less data than one batch, before loading
    saved = None
    if cfg.checkpoints.resume:
        path = find_checkpoint(os.path.join(cfg.out_dir, "checkpoints"), cfg.checkpoints.resume)
        saved = {**read_trainer_state(path), "path": path}
        saved["config"].setdefault(
            "lora", asdict(LoraConfig())
        )  # saved before LoRA existed: full fine-tuning
        check_same_run(
            saved, json.loads(json.dumps(_identity(cfg, data))), _SAME_RUN
        )  # tuples as saved

    def make():  # the model as trained, its parameters on the meta device; build_sharded fills them
        return prepare_model(cfg, build_model(model_config))

    on_rank0(
        functools.partial(find_weights, cfg.model), share=False
    )  # a hub id downloads once; the others wait
    weights = open_weights(
        cfg.model, model_config, cfg.seed
    )  # every rank maps the files and reads its own rows
    if cfg.lora.lora_rank:
        weights = initial_weights(
            probe, weights
        )  # the base's weights under peft's names, and the adapters
    policy = build_sharded(make, weights, precision.mp_policy, device, cfg.fsdp).train(
        cfg.dropout
    )  # or eval
    reference = None
    online = cfg.objective.ref == "online" and not cfg.objective.reference_free
    if online and cfg.lora.lora_rank:
        reference = WithoutAdapters(policy)
    elif online:
        reference = build_sharded(make, weights, precision.mp_policy, device, cfg.fsdp, frozen=True)
    del weights
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    run = Run(
        cfg,
        device,
        precision,
        tokenizer,
        train,
        evals,
        data,
        demo,
        steps,
        saved["step"] if saved else 0,
        pad_id,
        policy,
        reference,
    )
    say(
        f"{cfg.model}: {sharded_line(policy)}, {precision.name}, {run.steps.total_steps} steps x "
        f"{cfg.batching.batch_size} pairs; peak host memory after loading, GB by rank: "
        + " ".join(f"{x:.2f}" for x in host_memory_by_rank_gb(device))
    )
    if cfg.objective.ref == "precompute" and not cfg.objective.reference_free:
        run.ref_tables = load_or_precompute_ref(run, model_config)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=True,
    )
    if saved:
        rngs = load_checkpoint(
            saved["path"], policy, optimizer, reference if cfg.objective.sync_ref_model else None
        )
        if saved["scaler"]:
            precision.scaler.load_state_dict(saved["scaler"])  # a pass-through scaler ignores it
        note = (
            ""
            if rngs
            else f" (saved on {saved['world_size']} ranks: random generators not restored)"
        )
        say(f"resumed from {saved['path']} at step {run.start_step}{note}")
    return run, optimizer


def _identity(cfg: Config, data: dict) -> dict:
    """What a checkpoint records of its run, for check_same_run: the config and what it implies."""
    return {"config": asdict(cfg), "data_sha256": data["train_sha256"]}


# ------------------------------------------------------------------------------------------- models
def prepare_model(cfg: Config, model):
    """The model as trained: its output layer scores responses alone (loss.ScoredHead); LoRA's
    adapters on."""
    add_scored_head(model)
    if not cfg.lora.lora_rank:
        return model
    model = add_adapters(model, cfg.lora, find_block_class(model), cfg.seed)
    if not isinstance(model.get_output_embeddings(), ScoredHead):
        raise ValueError(
            "--lora-targets: the output layer takes no adapters here (it computes the log-probs)"
        )
    return model


def load_or_precompute_ref(run: Run, model_config) -> dict[str, torch.Tensor]:
    """--ref precompute's {"train", "eval"}: (N, 2) [chosen, rejected] summed log-probs of the
    untrained policy (LoRA: adapters off), cached in {cache_dir}/ref-<hash>.safetensors, keyed by
    all they depend on."""
    key = {
        "model": on_rank0(
            functools.partial(model_identity, run.cfg.model, model_config, run.cfg.seed)
        ),
        "data": run.data["fingerprint"],
        "precision": run.precision.name,  # rank 0's: nodes' file times differ
        "ld_alpha": run.cfg.objective.ld_alpha,
    }
    path = os.path.join(run.cfg.dataset.cache_dir, f"ref-{key_digest(key)[:20]}.safetensors")
    if on_rank0(functools.partial(os.path.exists, path)):
        say(f"reference log-probs: {path} (cached)")
        return safetensors.torch.load_file(path, device=str(run.device))
    reference = WithoutAdapters(run.policy) if run.cfg.lora.lora_rank else run.policy
    ld = run.cfg.objective.ld_alpha
    with inference(run.policy):
        tables = {
            split: pair_table(
                pairs,
                2,
                lambda idx, batch: response_logps(reference, batch, ld).view(2, -1).T,
                run.cfg.batching.micro_batch_size,
                run.pad_id,
                run.device,
            )
            for split, pairs in (("train", run.train), ("eval", run.eval))
        }  # (B, 2) a batch
    tensors = {k: v.cpu() for k, v in tables.items()}
    write = functools.partial(
        safetensors.torch.save_file, tensors, metadata={"key": json.dumps(key, default=str)}
    )
    on_rank0(functools.partial(write_atomic, path, write), share=False)
    say(f"reference log-probs: computed {len(run.train) + len(run.eval)} pairs, cached at {path}")
    return tables


# -------------------------------------------------------------------------------------- bookkeeping
def save(run: Run, optimizer, step: int) -> str:
    """A sharded checkpoint of `step`, with what a bit-exact resume needs beside the weights."""
    cfg, scaler = run.cfg, run.precision.scaler
    per_epoch = run.steps.steps_per_epoch
    position = {
        "epoch": step // per_epoch,
        "pairs_consumed": step % per_epoch * cfg.batching.batch_size,
    }
    extra = {
        "step": step,
        **_identity(cfg, run.data),
        "data_position": position,
        "schedule": {
            "lr": cfg.lr,
            "warmup_steps": cfg.warmup_steps,
            "total_steps": run.steps.total_steps,
        },
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
    }
    synced = (
        run.reference if cfg.objective.sync_ref_model else None
    )  # TR-DPO's reference changes: saved too
    return save_checkpoint(
        os.path.join(cfg.out_dir, "checkpoints"),
        step,
        run.policy,
        optimizer,
        extra,
        keep_last=cfg.checkpoints.keep_last,
        background=cfg.checkpoints.async_save,
        reference=synced,
    )


def export_final(run: Run, log: RunLog) -> None:
    """{out_dir}/final, written by rank 0: the policy as a Hugging Face folder in --export-dtype
    (LoRA: a peft adapter folder, or the merged weights), the tokenizer and the resolved config;
    then the log is closed."""
    cfg, rss = run.cfg, host_memory_by_rank_gb(run.device)
    say("peak host memory during training, GB by rank: " + " ".join(f"{x:.2f}" for x in rss))
    final, dtype = os.path.join(cfg.out_dir, "final"), getattr(torch, cfg.export_dtype)
    entries = full_tensors(
        run.policy, run.device
    )  # every rank gathers one tensor at a time; rank 0 writes
    if cfg.lora.lora_rank and not cfg.lora.export_merged:  # the adapters alone
        adapters = {
            k: fetch().to("cpu", dtype) for k, tensor, fetch in entries if tensor.requires_grad
        }
        base = None if cfg.model == "tiny" else cfg.model  # the tiny base is a function of --seed
        on_rank0(functools.partial(save_adapters, run.policy, final, adapters, base), share=False)
    elif cfg.lora.lora_rank:  # --export-merged
        save_pretrained(
            final, run.policy.get_base_model(), merged_entries(run.policy, entries), dtype
        )
    else:
        save_pretrained(final, run.policy, entries, dtype)
    on_rank0(
        functools.partial(save_files, final, run.tokenizer, {"train_config.json": asdict(cfg)}),
        share=False,
    )
    say(f"saved {final}")
    on_rank0(log.close)  # only rank 0 has files (and W&B) to close; the others wait for it


# --------------------------------------------------------------------------------------------- main
def _raise_config_error(event) -> None:
    """A config's own ValueError reaches main() as one line, not tyro's box (tyro._errors: pinned
    tyro's hook)."""
    if (
        isinstance(event, tyro._errors.InstantiationFailure) and event.argument is None
    ):  # not a bad value's
        raise ValueError(event.message)


def main(argv: list[str] | None = None) -> None:
    transformers.utils.logging.disable_progress_bar()
    try:  # repeated --data / --eval-data flags append
        with tyro._errors.on_parse_error(_raise_config_error):
            cfg = tyro.cli(Config, args=argv, config=(tyro.conf.UseAppendAction,))
        rank, world, device = init_distributed(cfg.fsdp.device, cfg.fsdp.replicas)
    except ValueError as e:
        say(f"error: {e}")
        sys.exit(2)
    try:
        code = train(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        exit_without_shutdown(e.code)
    exit_without_shutdown(0)
