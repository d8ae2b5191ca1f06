"""DPO training with FSDP2 mixed precision, one code path for 1..N ranks. Reads top to bottom: the
config; train(), the loop; train_step(), the DPO step; then what they call (setup, models,
evaluation, checkpoints, export).

    python train_dpo.py  # tiny model, built-in demo data, CPU is fine
    torchrun --nproc_per_node=8 train_dpo.py --precision bf16 --model <hub id or dir> \\
        --data prefs.jsonl
"""

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Literal

import safetensors.torch
import torch
import torch.distributed as dist
import transformers
import tyro

import batches
import checkpoint
import data
import demo
import fsdp_setup
import generate
import logps
import lora
import loss
import memory
import metrics
import models
import precision
import schedule

# Imported by name: in Config's annotation, `lora` would be the field, not the module.
from lora import LoraConfig

# Every sub-config's flags are top-level: --beta, not --objective.beta.
_FLAGS = tyro.conf.OmitArgPrefixes


# ------------------------------------------------------------------------------------------ config
# The comment right above each group of flags is its description in --help: tyro reads it.
@dataclass
class Config:
    """DPO, 14 more preference losses, SFT and LoRA on 1 to N GPUs with FSDP2 mixed precision.

    python train_dpo.py  # the built-in demo: an SFT stage, then DPO; a CPU is fine

    torchrun --nproc_per_node=8 train_dpo.py --precision bf16 --model Qwen/Qwen2.5-0.5B-Instruct
    --data hub:HuggingFaceH4/ultrafeedback_binarized:train_prefs

    Flags are grouped below by what they set; README.md and docs/flags.md say more."""

    model: str = "tiny"
    """Hub id, local folder, or "tiny" (random-init Llama, byte tokenizer, no download); also the
    reference. With no --model and no --data: the demo's SFT stage (see --warm-start)."""
    # What trains and how it is cut: pairs, K scored responses or on-policy rows; the held-out
    # split; lengths; the chat template; the token cache.
    dataset: Annotated[data.DataConfig, _FLAGS] = field(default_factory=data.DataConfig)
    # How rows make steps: the batch, the micro-batch, the pairs a row gives, how long to train.
    batching: Annotated[batches.BatchConfig, _FLAGS] = field(default_factory=batches.BatchConfig)
    # The loss and its options, and how the reference is computed.
    objective: Annotated[loss.LossConfig, _FLAGS] = field(default_factory=loss.flag_defaults)
    # The compute dtype (master weights stay float32), gradient clipping, non-finite steps.
    mixed_precision: Annotated[precision.PrecisionConfig, _FLAGS] = field(
        default_factory=precision.PrecisionConfig
    )
    # Where the model runs and how FSDP2 shards it: HSDP, recompute, compile, offload.
    fsdp: Annotated[fsdp_setup.FSDPConfig, _FLAGS] = field(default_factory=fsdp_setup.FSDPConfig)
    # LoRA adapters (the reference is the base with them off), and their export.
    lora: Annotated[LoraConfig, _FLAGS] = field(default_factory=LoraConfig)
    # Held-out evaluation and the completions sampled at each.
    sampling: Annotated[generate.SampleConfig, _FLAGS] = field(
        default_factory=generate.SampleConfig
    )
    # Sharded checkpoints, and resuming from one.
    checkpoints: Annotated[checkpoint.CheckpointConfig, _FLAGS] = field(
        default_factory=checkpoint.CheckpointConfig
    )
    # Each GPU's memory, planned before launch (--plan), and --micro-batch-size auto's budget.
    memory_plan: Annotated[memory.PlanConfig, _FLAGS] = field(default_factory=memory.PlanConfig)
    lr: float | None = None
    """Peak learning rate. Default: 1e-3 for tiny (from scratch), 5e-7 (DPO paper), 5e-6 with
    --lora-rank (TRL)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    # The learning rate's warmup and decay.
    scheduling: Annotated[schedule.ScheduleConfig, _FLAGS] = field(
        default_factory=schedule.ScheduleConfig
    )
    out_dir: str = "runs/dpo"
    """Where metrics.jsonl, checkpoints/ and final/ (the Hugging Face export) go."""
    # Logging to Weights & Biases besides metrics.jsonl.
    wandb: Annotated[metrics.WandbConfig, _FLAGS] = field(default_factory=metrics.WandbConfig)
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Hugging Face export in {out_dir}/final; float32 is the master weights as
    trained."""
    seed: int = 0
    """Seeds the tiny model's init and the data order."""
    warm_start: bool = True
    """With the tiny model on the demo's data (no --model, no --data), first train the demo's SFT
    stage (once; then found in --cache-dir) and run DPO from it, so that its samples visibly move.
    --no-warm-start: DPO from random weights."""
    dropout: bool = False
    """Keep the model's dropout on in the policy. Off (as in TRL): it makes the log-ratios noisy
    from step 1."""

    def __post_init__(self):
        # A copy runs LossConfig.__post_init__ again, which resolves loss.flag_defaults' empty loss
        # list (the command line's default) to dpo, with weight 1.
        self.objective = replace(self.objective)
        # tiny trains from scratch. Otherwise the DPO paper's rate, or with LoRA that of TRL's LoRA
        # DPO example.
        if self.lr is None and self.model == "tiny":
            self.lr = 1e-3
        elif self.lr is None:
            self.lr = 5e-6 if self.lora.lora_rank else 5e-7
        # What must hold, and what is said where it does not.
        checks = [
            (0 <= self.lr < math.inf, f"--lr must be a finite number >= 0, got {self.lr}"),
            (0 <= self.seed < 2**63, f"--seed must be in [0, 2^63), got {self.seed}"),
            (
                0 <= self.weight_decay < math.inf,
                f"--weight-decay must be a finite number >= 0, got {self.weight_decay}",
            ),
            (
                not (self.lora.lora_rank and self.objective.sync_ref_model),
                "--sync-ref-model: with --lora-rank the reference is the base model, which never "
                "changes",
            ),
            # The offloaded state is in host memory already: a background save would stage a
            # second host copy of all of it (pinned, on GPUs).
            (
                not (self.checkpoints.async_save and self.fsdp.cpu_offload),
                "--async-save with --cpu-offload would copy the whole host-resident state again: "
                "save in the foreground (drop --async-save)",
            ),
            # Without --dropout the policy trains in eval mode, where no dropout runs.
            (
                self.dropout or not self.lora.lora_dropout,
                "--lora-dropout needs --dropout: dropout runs only in train mode, which --dropout "
                "turns on (the model's own dropout too, where its config has any)",
            ),
        ]
        for holds, message in checks:
            if not holds:
                raise ValueError(message)
        if self.objective.reward_model:
            # A reward model samples nothing, and its LoRA export is the merged classifier.
            self.sampling.num_samples = 0
            self.lora.export_merged = bool(self.lora.lora_rank)


# Resuming with any of these changed is refused; all else may change (--max-steps, --lr, the
# precision, ...). Every option of the loss counts, but not --ref: how the reference is computed.
_SAME_RUN = {
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            "model",
            "data",
            "seed",
            "eval_fraction",
            "batch_size",
            "max_length",
            "max_prompt_length",
            "missing_eos_penalty",
            "truncation",
            "group_by_length",
            "share_prompt",
            "pairs",
            "lora_rank",
            "lora_alpha",
            "lora_targets",
            *(f.name for f in fields(loss.LossConfig) if f.name != "ref"),
        )
    },
    "data_sha256": "the tokenized --data (its content, cut by this code)",
    "no_reference": "--ref none",
}


# ---------------------------------------------------------------------------------------- the loop
def train(
    cfg: Config, device: torch.device, resume_hint: str = "continue with --resume latest"
) -> int:
    """Everything that needs the process group: setup, then each step's learning rate, the step,
    TR-DPO's sync, logging, skip accounting, evaluation, checkpoints and a requested stop (saved,
    then `resume_hint` said); the export at the end. Returns the exit code."""
    run, optimizer = setup(cfg, device)
    log = metrics.RunLog(
        cfg.out_dir, run.start_step, samples=cfg.sampling.num_samples > 0 and len(run.eval) > 0
    )
    if cfg.wandb.wandb_project:
        # Rank 0's run. Its failure (no API key on a batch node) stops every rank at once.
        log.wandb = fsdp_setup.on_rank0(
            metrics.open_wandb,
            cfg.wandb,
            asdict(cfg),
            cfg.out_dir,
            run.start_step > 0,
            share=False,
        )
    log.write_data(
        {"train": run.data["train"], "eval": run.data["eval"]},
        run.start_step == 0,
        cfg.batching.pairs,
    )
    saver = checkpoint.Checkpointer(
        os.path.join(cfg.out_dir, "checkpoints"),
        keep_last=cfg.checkpoints.keep_last,
        background=cfg.checkpoints.async_save,
        resume_hint=resume_hint,
    )
    # SIGTERM, SIGUSR1 or SIGINT: finish the step, save, exit.
    stop = checkpoint.StopRequest()
    # What every GPU together can do in this precision, for MFU; None on a CPU.
    peak_flops = metrics.group_peak_flops(device, run.precision.name)
    t0 = time.perf_counter()
    # Consecutive skipped steps that count toward --max-skipped-steps.
    bad_steps = 0
    if run.start_step == 0 and cfg.sampling.eval_before:
        # The baseline: where the samples and the curves start.
        evaluate_and_sample(run, log, 0, t0)

    # The first step's measured peak is its own, not loading's, --ref precompute's or evaluation's.
    metrics.reset_peak_memory(run.device)
    for step in range(run.start_step, run.steps.total_steps):
        step_t0 = time.perf_counter()
        done = step + 1
        lr = schedule.learning_rate(step, cfg.lr, cfg.scheduling, run.steps.total_steps)
        stats = train_step(run, optimizer, run.steps(step), lr, stop)
        if cfg.objective.sync_ref_model and (step + 1) % cfg.objective.ref_model_sync_steps == 0:
            # TR-DPO: the reference moves toward the policy, shard by shard (after a skipped step
            # too, as in TRL).
            fsdp_setup.mix_into(run.reference, run.policy, cfg.objective.ref_model_mixup_alpha)

        now = time.perf_counter()
        row = stats.row(done, lr, now - step_t0, peak_flops, now - t0)
        log.write(row)
        metrics.show_progress(done, run.steps.total_steps, row)
        if step == run.start_step:
            # Start-up's long waits are over: a rank that stops answering now ends the job soon.
            fsdp_setup.set_timeout(run.policy, cfg.fsdp.collective_timeout)
        if step == run.start_step and run.planned_gb is not None:
            metrics.say(memory.check_line(run.planned_gb, stats.peak_memory_gb))
        bad_steps = precision.count_bad_steps(
            bad_steps, stats.skipped, stats.means["loss"], run.precision.scaler
        )
        if bad_steps >= cfg.mixed_precision.max_skipped_steps:
            metrics.say(
                f"error: stopping at step {step + 1}: {bad_steps} consecutive steps since step "
                f"{step + 2 - bad_steps} had a non-finite loss or gradient norm"
            )
            saver.finish()
            log.close()
            return 1

        if (
            cfg.sampling.eval_every
            and done % cfg.sampling.eval_every == 0
            and done < run.steps.total_steps
        ):
            evaluate_and_sample(run, log, done, t0)
        if (
            cfg.checkpoints.save_every and done % cfg.checkpoints.save_every == 0
        ) or stats.stop_requested:
            path = save(run, saver, optimizer, step + 1)
        # A background save written by now moves `latest`; before a stop, wait for it.
        saver.finish(wait=stats.stop_requested)
        if stats.stop_requested:
            metrics.say(f"stopped by a signal after step {step + 1}: saved {path}; {resume_hint}")
            # The log's files and the W&B run are closed: the process then leaves without
            # interpreter shutdown.
            log.close()
            return stop.exit_code

    stop.restore()
    saver.finish()
    evaluate_and_sample(run, log, run.steps.total_steps, t0)
    # The export's gathers wait while rank 0 writes each file: start-up's timeout again.
    fsdp_setup.set_timeout(run.policy, fsdp_setup.START_TIMEOUT_S)
    export_final(run, log)
    return 0


def train_step(
    run: "Run",
    optimizer: torch.optim.Optimizer,
    batch: list[int],
    lr: float,
    stop: checkpoint.StopRequest,
) -> metrics.StepStats:
    """One optimizer step at learning rate `lr` on the global `batch` of row indices, of which
    this rank takes its share: for each micro-batch, the forward (reference, then policy), the loss
    and backward (scaled for fp16); then the statistics reduced over the ranks, fp16's unscale, the
    clip, and the update, skipped on every rank if any saw a non-finite loss or gradient norm."""
    cfg = run.cfg
    scaler = run.precision.scaler
    for group in optimizer.param_groups:
        group["lr"] = lr
    # The objective is the mean loss over the global batch's pairs (over its rows for a listwise
    # loss or SFT alone): counted on the host from the scores, so each rank's sum over its own is
    # scaled alike, and FSDP's average over the ranks gives that mean.
    n_pairs, tokens = batches.pair_counts(run.train, batch, run.layout)
    units = len(batch) if cfg.objective.listwise else n_pairs
    if cfg.objective.unpaired:
        # An unpaired loss's mean is over the responses.
        units = int((~run.train.scores[batch].isnan()).sum())
    sums = metrics.StepSums(run.device)
    coefficients = metrics.flop_coefficients(run.policy)

    groups = batches.micro_batch_groups(
        run.train, batch, dist.get_rank(), dist.get_world_size(), cfg.batching
    )
    for i, (idx, rows) in enumerate(
        batches.micro_batches(run.train, groups, run.device, run.layout)
    ):
        # By default each micro-batch's gradient is reduce-scattered at once, so that no rank holds
        # a full gradient.
        last = i == len(groups) - 1
        run.policy.set_requires_gradient_sync(last or not cfg.fsdp.unsharded_grad_accumulation)
        # sft's NLL is a token mean over the step's preferred responses: each pair's share is
        # over their mean length.
        ref = batches.table_rows(run.ref_tables["train"], idx, rows) if run.ref_tables else None
        out = micro_batch_loss(
            cfg.objective, run.policy, run.reference, rows, ref, tokens / max(n_pairs, 1)
        )
        scaler.scale(out.losses.sum() * (dist.get_world_size() / units)).backward()
        sums.add(
            metrics.row_sums(out, rows),
            metrics.batch_counts(
                coefficients,
                # The policy's forward and backward are 3 forwards' worth of FLOPs, or 2 with LoRA,
                # whose frozen weights get no gradient.
                2 if cfg.lora.lora_rank else 3,
                run.reference is not None,
                rows,
            ),
            out,
        )

    sums.all_reduce()
    # Two maxima in one all-reduce: the fullest rank's memory, and whether any rank must stop.
    maxima = torch.tensor(
        [metrics.peak_memory_gb(run.device), float(stop.signum > 0)], device=run.device
    )
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)

    # fp16: clip the true gradients, not the scaled ones.
    scaler.unscale_(optimizer)
    grad_norm = fsdp_setup.clip_grad_norm_(run.policy, cfg.mixed_precision.max_grad_norm)
    # A global norm and loss: a NaN or an fp16 overflow on any rank skips the step on all of them.
    skipped = not bool(torch.isfinite(grad_norm) & sums.loss_is_finite())
    if not skipped:
        scaler.step(optimizer)
    # fp16: an overflow on any rank lowers the scale on all (found_inf is reduced over the shards).
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    # Read on the host once the update is queued: no wait for the device before it.
    peak_memory_gb, stop_requested = maxima.tolist()
    return metrics.StepStats(
        **sums.totals(),
        grad_norm=grad_norm.item(),
        skipped=skipped,
        peak_memory_gb=peak_memory_gb,
        stop_requested=stop_requested > 0,
        loss_scale=scaler.get_scale() if scaler.is_enabled() else None,
    )


def micro_batch_loss(
    objective: loss.LossConfig,
    policy_model,
    reference,
    rows: batches.RowBatch,
    ref: torch.Tensor | None,
    tokens_per_pair: float,
) -> loss.Losses:
    """The objective on the micro-batch `rows`: the reference's log-probs (`ref`, from --ref
    precompute's table, else from the `reference` model, without gradients and first, so that its
    activations are freed before the policy's exist; both None for a reference-free loss), the
    policy's, then the loss of the objective's kind: per pair, per row (listwise) or per response
    (unpaired, whose reference point is reduced over the ranks here); or a reward model's loss on
    its rewards."""
    if objective.reward_model:
        rewards = rows.pair_sides(logps.response_rewards(policy_model, rows))
        return loss.reward_losses(rewards, rows.margins, objective.center_rewards_coefficient)
    if reference is not None:
        with torch.no_grad():
            ref = logps.response_logps(reference, rows, objective.ld_alpha)
    policy = logps.response_logps(policy_model, rows, objective.ld_alpha, objective.use_weighting)
    log_weights = None
    if objective.use_weighting:
        policy, log_weights = policy
        log_weights = rows.pair_sides(log_weights)
    if objective.unpaired:
        logratios = policy - ref
        real = len(logratios) - rows.mismatched
        kl = torch.zeros((), device=policy.device)
        if rows.mismatched:
            # KTO's reference point: TRL's gather, then mean, so each rank's micro-batch counts
            # alike; clamped at 0.
            kl = logratios[real:].detach().float().mean()
            dist.all_reduce(kl)
            kl = (kl / dist.get_world_size()).clamp(min=0)
        return loss.response_losses(
            objective,
            logratios[:real],
            policy[:real],
            rows.desirable,
            kl,
            rows.chosen_index,
            rows.rejected_index,
        )
    # ORPO's scored prompts come after the responses: each pair's, for its NLL. (With --ld-alpha
    # the policy's log-probs are pair sides, and no prompts follow them.)
    prompts = rows.pair_prompts(policy) if rows.scored_prompts else None
    policy = policy[: len(policy) - rows.scored_prompts]
    # Per response, for the ranking metrics: not with --ld-alpha, whose log-probs are per pair.
    per_response = ref is not None and objective.ld_alpha is None
    logratios = policy - ref if per_response else None
    if objective.listwise:
        out = loss.row_losses(
            objective,
            rows.by_row(logratios),
            rows.scores,
            rows.pair_sides(policy),
            rows.pair_sides(ref),
        )
        return replace(out, logratios=logratios)
    if objective.ld_alpha is None:
        policy = rows.pair_sides(policy)
        ref = None if ref is None else rows.pair_sides(ref)
    out = loss.pair_losses(
        objective,
        policy,
        ref,
        rows.pair_sides(rows.response_lengths),
        tokens_per_pair,
        log_weights,
        prompts,
    )
    return replace(out, logratios=logratios)


def evaluate_and_sample(run: "Run", log: metrics.RunLog, step: int, t0: float) -> None:
    """Means over the held-out set, completions of its first --num-samples prompts; both logged, a
    line shown."""
    if not len(run.eval):
        return

    n_pairs, tokens = batches.pair_counts(run.eval, range(len(run.eval)), run.layout)

    def row_sums(idx, rows):  # (B, metrics.ROW_COLUMNS)
        ref = batches.table_rows(run.ref_tables["eval"], idx, rows) if run.ref_tables else None
        out = micro_batch_loss(
            run.cfg.objective, run.policy, run.reference, rows, ref, tokens / max(n_pairs, 1)
        )
        return metrics.row_sums(out, rows)

    # Every rank evaluates and generates (FSDP needs them all); rank 0 writes.
    with fsdp_setup.inference(run.policy):
        table = batches.row_table(
            run.eval,
            (metrics.ROW_COLUMNS,),
            row_sums,
            run.cfg.batching.micro_batch_size,
            run.device,
            run.layout,
        )
        completions = generate.sample_completions(
            run.policy,
            run.tokenizer,
            [
                run.eval[i]["prompt"]
                for i in range(min(run.cfg.sampling.num_samples, len(run.eval)))
            ],
            run.cfg.sampling,
            run.layout.pad_id,
            run.cfg.seed,
            run.device,
        )
    means = metrics.row_means(table.sum(0))
    rows = [{"step": step, **c} for c in completions]
    demo.record_samples(run.demo, step, means, rows)
    log.write({"step": step, "split": "eval", **means, "elapsed_s": time.perf_counter() - t0}, rows)
    metrics.say(metrics.eval_line(step, len(run.eval), means, rows))


# ------------------------------------------------------------------------------------------- setup
@dataclass
class Run:
    """What prepare_run() decides and reads, and what setup() then builds, once."""

    cfg: Config
    device: torch.device
    precision: precision.Precision
    tokenizer: transformers.PreTrainedTokenizerBase
    model_config: transformers.PretrainedConfig
    train: data.RowTokens
    eval: data.RowTokens
    data: dict  # the tokenized data's summary: fingerprint, sha256, counts
    # The built-in demo's evaluations, [(step, preferred share, first sample)]: its samples have a
    # ground-truth scorer. None for other data.
    demo: list | None
    steps: batches.StepBatches  # each step's global batch
    layout: batches.Layout  # how micro-batches lay out rows
    # The checkpoint to resume from (checkpoint.resume_state), or None, and the step it holds.
    saved: dict | None
    start_step: int
    policy: torch.nn.Module | None = None
    # None with --ref precompute or a reference-free loss; with LoRA, the policy's base.
    reference: torch.nn.Module | None = None
    # --ref precompute: "train" and "eval", each batches.row_table's (N, K) per-response log-probs,
    # or with --ld-alpha (N, K, K), per pair.
    ref_tables: dict = field(default_factory=dict)
    # On a GPU, the plan of the first step's peak (plan_first_step), in GB, which train() checks.
    planned_gb: float | None = None


def setup(cfg: Config, device: torch.device) -> tuple[Run, torch.optim.Optimizer]:
    """The run, step by step: prepare_run() (all that reads no weights); the policy and (online) a
    frozen reference, sharded alike, each rank reading its own rows of the weights (LoRA: the
    reference is the base, adapters off); on a GPU, the first step's plan; --ref precompute's
    log-probs; AdamW over the float32 master weights that train; the state of the checkpoint resumed
    from (TR-DPO's reference too)."""
    run = prepare_run(cfg, device, cfg.model)
    # A hub id is downloaded by each node's first rank alone (nodes need not share a cache); the
    # others wait, then find it in the cache.
    fsdp_setup.on_rank0(models.find_weights, cfg.model, share=False, per_node=True)
    # Every rank maps the files and reads only its own rows.
    weights = models.open_weights(cfg.model, run.model_config, cfg.seed)
    if cfg.lora.lora_rank:
        # The base's weights under peft's names, and the adapters as drawn.
        trained = prepare_model(cfg, models.build_model(run.model_config))
        weights = lora.initial_weights(trained, weights)
    run.policy, run.reference = build_models(
        cfg, run.model_config, weights, run.precision.mp_policy, device
    )
    del weights
    metrics.say(
        f"{cfg.model}: {metrics.sharded_line(run.policy)}, {run.precision.name}, "
        f"{run.steps.total_steps} steps x {cfg.batching.batch_size} rows; peak host memory after "
        "loading, GB by rank: "
        + " ".join(f"{x:.2f}" for x in metrics.host_memory_by_rank_gb(device))
    )
    if device.type == "cuda":
        run.planned_gb = plan_first_step(run)
    if cfg.objective.ref == "precompute" and not cfg.objective.reference_free:
        run.ref_tables = load_or_precompute_ref(run)
    optimizer = torch.optim.AdamW(
        [p for p in run.policy.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=True,
    )
    if run.saved:
        # TR-DPO's reference was saved too.
        rngs = checkpoint.load_checkpoint(
            run.saved["path"],
            run.policy,
            optimizer,
            run.reference if cfg.objective.sync_ref_model else None,
            run.precision.scaler,
        )
        lost = f" (saved on {run.saved['world_size']} ranks: random generators not restored)"
        metrics.say(
            f"resumed from {run.saved['path']} at step {run.start_step}{'' if rngs else lost}"
        )
    return run, optimizer


def prepare_run(cfg: Config, device: torch.device, model: str) -> Run:
    """All of the run that reads no weights, so that what the user must fix fails first (a
    ValueError naming the flag or the file): resolve the config (in place: the micro-batch size);
    read `model`'s config and tokenizer (--model; for the demo's checks before its SFT stage,
    "tiny", whose config and tokenizer its export will have), the data (rank 0 tokenizes) and the
    resume state; with --plan or --micro-batch-size auto, plan each GPU's memory."""
    mixed = precision.resolve_precision(cfg.mixed_precision, device)
    if mixed.warning:
        metrics.say(f"warning: {mixed.warning}")
    tokenizer = data.load_tokenizer(model, cfg.dataset.chat_template)
    model_config = models.load_model_config(model, tokenizer, cfg.dataset.max_length)
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    if cfg.objective.reward_model:
        # One label builds the sequence classifier, which reads a text's score at its last token
        # that is not padding (as the export is read).
        model_config.num_labels = 1
        model_config.pad_token_id = pad_id
    if cfg.batching.packing and device.type == "cuda":
        # Packed rows' mask is block-diagonal: FlexAttention's block mask skips the blocks it masks
        # whole, where SDPA's dense mask computes them.
        model_config._attn_implementation = "flex_attention"
    # A bad --lora-targets (or --export-merged) fails here, before any weights are read.
    trained = prepare_model(cfg, models.build_model(model_config))
    # A probe of the model's own kind, cut down: whether shared rows score as separate ones.
    refusal = models.shared_prompt_refusal(trained.config, logps.shared_row_inputs)
    if cfg.batching.packing and refusal:
        raise ValueError(
            f"--packing: {model_config.model_type} with {trained.config._attn_implementation} "
            f"attention does not score packed rows exactly ({refusal})"
        )
    if cfg.batching.share_prompt and refusal:
        metrics.say(
            f"note: {model_config.model_type} with {trained.config._attn_implementation} "
            f"attention does not score a shared prompt exactly ({refusal}): separate rows "
            "(--no-share-prompt)"
        )
    # SFT alone runs no other responses to share a prompt with.
    cfg.batching = cfg.batching.resolve(
        dist.get_world_size(), not refusal and cfg.objective.pairwise
    )
    # The demo's files are data like any other, written once by rank 0.
    dataset, is_demo = fsdp_setup.on_rank0(demo.demo_config, cfg.dataset, data.write_jsonl)
    train_rows, eval_rows, summary = data.load_tokens(
        fsdp_setup.on_rank0(data.tokenize_to_cache, dataset, tokenizer, metrics.say)
    )
    if summary["train"]["unpaired"] and not cfg.objective.unpaired:
        raise ValueError(
            f"--data {' '.join(cfg.dataset.data)}: unpaired rows (prompt, completion, label) train "
            f"--loss kto or apo_zero_unpaired, not {' '.join(cfg.objective.loss)}"
        )
    if cfg.objective.unpaired:
        advice = loss.kto_weight_advice(batches.response_labels(train_rows.scores), cfg.objective)
        if advice:
            metrics.say(f"warning: {advice}")
    if "kto" in cfg.objective.loss:
        # KTO's KL estimate: each row carries its mismatched completions.
        train_rows = data.with_mismatched(train_rows, cfg.dataset.max_length)
        eval_rows = data.with_mismatched(eval_rows, cfg.dataset.max_length)
    # Rank 0 resolves "latest" for all (another node may still see its old target), or finds no
    # other run's checkpoints where a new run would write.
    saved = fsdp_setup.on_rank0(
        checkpoint.resume_state,
        os.path.join(cfg.out_dir, "checkpoints"),
        cfg.checkpoints.resume,
        _identity(cfg, summary),
        _SAME_RUN,
    )
    layout = cfg.batching.layout(pad_id, not cfg.objective.pairwise, "orpo" in cfg.objective.loss)
    auto_tokens = cfg.batching.micro_batch_tokens == "auto"
    if cfg.memory_plan.plan or cfg.batching.micro_batch_size == "auto" or auto_tokens:
        micro, table = memory.choose(
            plan_memory(cfg, device, mixed, model_config, train_rows),
            cfg.memory_plan,
            device,
            "auto" if auto_tokens else cfg.batching.micro_batch_size,
        )
        cfg.batching = replace(cfg.batching, micro_batch_size=micro)
        metrics.say(table)
    if auto_tokens:
        # The plan's micro-batch of `micro` rows, packed, fits: so does any of as many tokens.
        longest = [train_rows[i] for i in batches.longest_rows(train_rows, micro)]
        tokens = layout.collate(longest).input_ids.numel()
        cfg.batching = replace(cfg.batching, micro_batch_tokens=tokens)
        metrics.say(f"--micro-batch-tokens auto: {tokens}, the {micro} longest rows packed")
    return Run(
        cfg=cfg,
        device=device,
        precision=mixed,
        tokenizer=tokenizer,
        model_config=model_config,
        train=train_rows,
        eval=eval_rows,
        data=summary,
        demo=[] if is_demo else None,
        # Refuses less data than one batch, before any weights are read.
        steps=batches.StepBatches(train_rows.lengths, cfg.batching, cfg.seed),
        layout=layout,
        saved=saved,
        start_step=saved["step"] if saved else 0,
    )


def build_models(cfg: Config, model_config, weights: dict | None, mp_policy, device: torch.device):
    """(policy, reference) of `model_config` as trained (prepare_model), sharded alike, each rank
    reading its own rows of `weights` (None: left on the meta device, for a memory plan). The
    policy in eval mode (no dropout) unless --dropout; the reference None with --ref precompute or
    a reference-free loss, with LoRA the policy's base (adapters off)."""

    def make():  # parameters on the meta device; build_sharded fills them
        return prepare_model(cfg, models.build_model(model_config))

    policy = fsdp_setup.build_sharded(make, weights, mp_policy, device, cfg.fsdp).train(cfg.dropout)
    if cfg.objective.ref != "online" or cfg.objective.reference_free:
        return policy, None
    if cfg.lora.lora_rank:
        return policy, lora.WithoutAdapters(policy)
    return policy, fsdp_setup.build_sharded(make, weights, mp_policy, device, cfg.fsdp, frozen=True)


def plan_memory(
    cfg: Config, device: torch.device, mixed, model_config, tokens, among: list[int] | None = None
) -> memory.Plan:
    """Each GPU's memory for a step at each micro-batch size (memory.plan_run), traced on fake
    models built as training builds them, on micro-batches of the data's longest rows laid out as
    training lays them out; without --data, of rows of a --max-prompt-length prompt and
    --plan-responses responses that fill --max-length. among: instead, the run's micro-batch size
    alone, of the longest of these rows. The output layer is fused into the loss, as on a GPU,
    wherever the plan is traced."""
    per_rank = cfg.batching.batch_size // dist.get_world_size()
    if among is None and not cfg.dataset.data:
        tokens = data.synthetic_rows(
            per_rank,
            cfg.dataset.prompt_limit,
            cfg.dataset.max_length,
            cfg.memory_plan.plan_responses,
        )
        if "kto" in cfg.objective.loss:
            tokens = data.with_mismatched(tokens, cfg.dataset.max_length)
    layout = cfg.batching.layout(0, not cfg.objective.pairwise, "orpo" in cfg.objective.loss)

    def build():  # (policy, reference) on the meta device
        return build_models(cfg, model_config, None, mixed.mp_policy, device)

    def collate(size):  # the `size` longest rows (of `among`)
        return layout.collate([tokens[i] for i in batches.longest_rows(tokens, size, among)])

    def micro_batch(policy, rows):  # forward and backward, the reference's log-probs given
        # One per response (per pair side for LD-DPO), as --ref precompute's table gives them.
        sides = len(rows.response_rows)
        if cfg.objective.ld_alpha is not None:
            sides = 2 * len(rows.chosen_index)
        ref = torch.zeros(sides, device=device)
        micro_batch_loss(
            cfg.objective, policy, None, rows.to(device), ref, 1.0
        ).losses.sum().backward()

    return memory.plan_run(
        build,
        collate,
        micro_batch,
        per_rank,
        device,
        None if among is None else [cfg.batching.micro_batch_size],
        cfg.fsdp.unsharded_grad_accumulation,
        cfg.fsdp.cpu_offload,
        {logps.__file__: "output layer and loss", loss.__file__: "output layer and loss"},
        logps.fused_head(),
    )


def plan_first_step(run: Run) -> float | None:
    """GB: the plan of this run's first step on its fullest GPU, to check against the step's
    measured peak: on each rank, of its longest rows of the step as one micro-batch of the run's
    size (so an upper bound where the step's micro-batches differ in length). None where any rank
    could not plan it (memory.fullest_rank_gb warns): the check is skipped, the run goes on."""
    mine = batches.rank_share(run.steps(run.start_step), dist.get_rank(), dist.get_world_size())
    return memory.fullest_rank_gb(
        run.cfg.batching.micro_batch_size,
        run.start_step == 0,
        run.device,
        plan_memory,
        run.cfg,
        run.device,
        run.precision,
        run.model_config,
        run.train,
        mine,
    )


def _identity(cfg: Config, summary: dict) -> dict:
    """What a checkpoint records of its run, for check_same_run: the config and what it implies."""
    # --ref none changes the objective (CPO); online and precompute only how the reference runs.
    return {
        "config": asdict(cfg),
        "data_sha256": summary["train_sha256"],
        "no_reference": cfg.objective.ref == "none",
    }


# ------------------------------------------------------------------------------------------ models
def prepare_model(cfg: Config, model):
    """The model as trained: its output layer scores responses alone (logps.ScoredHead), or a
    reward model's scalar head; LoRA's adapters on, with a reward model's head trained whole."""
    if not cfg.objective.reward_model:
        logps.add_scored_head(model)
    if not cfg.lora.lora_rank:
        return model
    # The output layer computes the log-probs: lora.add_adapters refuses adapters on it.
    model = lora.add_adapters(model, cfg.lora, fsdp_setup.find_block_class(model), cfg.seed)
    if cfg.objective.reward_model:
        logps.reward_head(model).requires_grad_(True)
    return model


def load_or_precompute_ref(run: Run) -> dict[str, torch.Tensor]:
    """--ref precompute's {"train", "eval"}: (N, K) summed log-probs of each row's responses by the
    untrained policy (LoRA: adapters off), or with --ld-alpha (N, K, K) of each response against
    each it pairs with; cached in {cache_dir}/ref-<hash>.safetensors, keyed by all they depend
    on."""
    key = {
        # Rank 0's identity of the model: file times may differ between nodes.
        "model": fsdp_setup.on_rank0(
            models.model_identity, run.cfg.model, run.model_config, run.cfg.seed
        ),
        "data": run.data["fingerprint"],
        "precision": run.precision.name,
        "ld_alpha": run.cfg.objective.ld_alpha,
        # The layout changes the sums' rounding: a table made in one is not the other's.
        "share_prompt": run.cfg.batching.share_prompt,
        "packing": run.cfg.batching.packing,
        # LD-DPO's entries are of the pairs made.
        "pairs": run.cfg.batching.pairs,
        # KTO's rows hold their mismatched completions too.
        "responses": run.train.lengths.shape[1],
    }
    path = os.path.join(run.cfg.dataset.cache_dir, f"ref-{data.key_digest(key)[:20]}.safetensors")
    if fsdp_setup.on_rank0(os.path.exists, path):
        metrics.say(f"reference log-probs: {path} (cached)")
        return safetensors.torch.load_file(path, device=str(run.device))
    reference = lora.WithoutAdapters(run.policy) if run.cfg.lora.lora_rank else run.policy
    with fsdp_setup.inference(run.policy):
        tables = {
            split: batches.response_table(
                tokens,
                # (R,), or (2P,) pair sides with --ld-alpha
                lambda rows: logps.response_logps(reference, rows, run.cfg.objective.ld_alpha),
                run.cfg.objective.ld_alpha is not None,
                run.cfg.batching.micro_batch_size,
                run.device,
                run.layout,
            )
            for split, tokens in (("train", run.train), ("eval", run.eval))
        }
    fsdp_setup.on_rank0(
        data.write_atomic,
        path,
        lambda tmp: safetensors.torch.save_file(
            {split: table.cpu() for split, table in tables.items()},
            tmp,
            metadata={"key": json.dumps(key, default=str)},
        ),
        share=False,
    )
    metrics.say(
        f"reference log-probs: computed {len(run.train) + len(run.eval)} rows, cached at {path}"
    )
    return tables


# ------------------------------------------------------------------------------------- bookkeeping
def save(run: Run, saver: checkpoint.Checkpointer, optimizer, step: int) -> str:
    """A sharded checkpoint of `step`, with what a bit-exact resume needs beside the weights."""
    extra = {
        "step": step,
        **_identity(run.cfg, run.data),
        "data_position": {
            "epoch": step // run.steps.steps_per_epoch,
            "rows_consumed": step % run.steps.steps_per_epoch * run.cfg.batching.batch_size,
        },
        "schedule": {
            "lr": run.cfg.lr,
            **asdict(run.cfg.scheduling),
            "total_steps": run.steps.total_steps,
        },
    }
    return saver.save(
        step,
        run.policy,
        optimizer,
        extra,
        # TR-DPO's reference changes as it trains: it is saved too.
        run.reference if run.cfg.objective.sync_ref_model else None,
        run.precision.scaler,
    )


def export_final(run: Run, log: metrics.RunLog) -> None:
    """{out_dir}/final, written by rank 0: the policy as a Hugging Face folder in --export-dtype
    (LoRA: a peft adapter folder, or the merged weights), the tokenizer and the resolved config;
    then the log is closed."""
    metrics.say(
        "peak host memory during training, GB by rank: "
        + " ".join(f"{x:.2f}" for x in metrics.host_memory_by_rank_gb(run.device))
    )
    final = os.path.join(run.cfg.out_dir, "final")
    dtype = getattr(torch, run.cfg.export_dtype)
    try:
        # Every rank gathers one tensor at a time; rank 0 writes.
        entries = fsdp_setup.full_tensors(run.policy, run.device)
        if run.cfg.lora.lora_rank and not run.cfg.lora.export_merged:
            if run.cfg.model == "tiny":
                # The tiny base is saved nowhere else (a function of --seed): its weights go beside
                # the adapters, where from_pretrained(final) finds them.
                models.save_pretrained(
                    final, run.policy.get_base_model(), lora.base_entries(entries), dtype
                )
            # The adapters, naming their base.
            fsdp_setup.on_rank0(
                lora.save_adapters,
                run.policy,
                final,
                {
                    k: fetch().to("cpu", dtype)
                    for k, tensor, fetch in entries
                    if tensor.requires_grad
                },
                os.path.abspath(final) if run.cfg.model == "tiny" else run.cfg.model,
                share=False,
            )
        elif run.cfg.lora.lora_rank:
            models.save_pretrained(
                final, run.policy.get_base_model(), lora.merged_entries(run.policy, entries), dtype
            )
        else:
            models.save_pretrained(final, run.policy, entries, dtype)
        fsdp_setup.on_rank0(
            fsdp_setup.save_files,
            final,
            run.tokenizer,
            {"train_config.json": asdict(run.cfg)},
            share=False,
        )
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        # A full disk: final/ is removed, never left half-written.
        shutil.rmtree(final, ignore_errors=True)
        reason = str(e).strip().partition("\n")[0]
        raise ValueError(f"{final}: the export failed ({reason}); it is removed") from None
    metrics.say(f"saved {final}")
    if run.demo:
        metrics.say(demo.what_moved(run.demo))
    # Only rank 0 has files (and W&B) to close; the others wait for it.
    fsdp_setup.on_rank0(log.close)


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    transformers.utils.logging.disable_progress_bar()
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = _parse(argv)
        # A plan needs no SFT stage: its model is the tiny one.
        stages = demo.warm_start(
            cfg.warm_start and not cfg.memory_plan.plan,
            cfg.model,
            cfg.dataset.data,
            cfg.objective.pairwise,
            cfg.dataset.cache_dir,
        )
        if stages:
            # The run asked for, from the demo's SFT model; its own flags come last and win.
            cfg = _parse([*stages.dpo_flags, *argv])
            metrics.say(stages.line)
        if stages and stages.sft_flags:
            # Every check of the DPO run that reads no weights passes before the stage starts. The
            # stage's model will be the tiny one, trained: its config and tokenizer stand in.
            run_process_group(cfg, prepare_run, "tiny")
            run_process_group(_parse(stages.sft_flags), train, stages.resume_hint)
        if cfg.memory_plan.plan:
            run_process_group(cfg, prepare_run, cfg.model)
        else:
            run_process_group(cfg, train)
    except ValueError as e:
        metrics.say(f"error: {e}")
        sys.exit(2)


def _parse(argv: list[str]) -> Config:
    # Repeated --data, --eval-data, --loss flags append. Every parse error is one line, as
    # generate.py's are.
    return generate.parse_flags(Config, argv, tyro.conf.UseAppendAction)


def run_process_group(cfg: Config, fn, *args) -> None:
    """fn(cfg, device, *args) in a process group of its own (train, or prepare_run's checks alone);
    exits with the code train returns, unless 0."""
    _, _, device = fsdp_setup.init_distributed(
        cfg.fsdp.device,
        cfg.fsdp.replicas,
        deterministic=cfg.fsdp.deterministic,
        fake_world=memory.planned_gpus(cfg.memory_plan),
    )
    try:
        code = fn(cfg, device, *args)
    except RuntimeError as e:
        # gloo's words for a collective that waited past --collective-timeout (on GPUs, NCCL's
        # watchdog ends the process with its own line).
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        other = f"rank {1 - dist.get_rank()}" if dist.get_world_size() == 2 else "a rank"
        metrics.say(
            f"error: rank {dist.get_rank()}: {other} stopped answering: a collective waited "
            f"--collective-timeout {cfg.fsdp.collective_timeout} s ({e}); --resume latest "
            "resumes from the last checkpoint"
        )
        code = 1
    finally:
        dist.destroy_process_group()
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    fsdp_setup.run_and_exit(main)
