"""DPO training with FSDP2 mixed precision. One code path for 1..N ranks.

    python train_dpo.py                                   # tiny model, built-in demo data, CPU is fine
    torchrun --nproc_per_node=8 train_dpo.py --precision bf16 --model <hub id or dir> --data prefs.jsonl

Reads top to bottom: config, distributed, precision, data, models, optimizer, loop, save.
"""

import functools
import hashlib
import importlib.util
import inspect
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Annotated, Literal

import safetensors.torch
import torch
import torch.distributed as dist
import transformers
import tyro

from checkpoint import StopRequest, check_same_run, find_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint
from data import (DataConfig, build_batches, build_eval_batches, collate_pairs, load_tokenizer, pair_lengths,
                  prepare_data)
from demo import score_completion, write_demo
from fsdp_setup import FSDPConfig, apply_ac, apply_fsdp, gather_full_state_dict, init_distributed, load_from_rank0
from loss import IGNORE_INDEX, LossConfig, chosen_nll, preference_loss, sequence_logps
from metrics import (PAIR_METRICS, device_peak_flops, host_memory_by_rank_gb, open_log, open_wandb, pair_means,
                     pair_sums, peak_memory_gb, plot_metrics, say, show_progress)
from precision import PrecisionConfig, clip_and_step, resolve_precision
from samples import generate


# ---------------------------------------------------------------------------------------------- config
@dataclass
class Config:
    model: str = "tiny"
    """Hub id, local folder, or "tiny" (random-init Llama, byte tokenizer, no download). Reference: a frozen copy."""
    dataset: Annotated[DataConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=DataConfig)
    objective: Annotated[LossConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=LossConfig)
    mixed_precision: Annotated[PrecisionConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=PrecisionConfig)
    fsdp: Annotated[FSDPConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=FSDPConfig)
    ref: Literal["online", "precompute"] = "online"
    """online: a frozen reference model runs every batch. precompute: one pass caches all reference log-probs first
    (no second model in memory; for >1 epoch or tight memory)."""
    cache_dir: str = "runs/cache"
    """Where tokenized data (tokens-<hash>.pt) and --ref precompute log-probs (ref-<hash>.safetensors) are kept,
    reused by any run with the same inputs and settings. Must be shared by all ranks, like --out-dir."""
    batch_size: int = 32
    """Global preference pairs per optimizer step, over all ranks and accumulation steps."""
    micro_batch_size: int | None = None
    """Pairs per rank per forward (2x rows). Default: batch-size / ranks. Accumulation = batch / (micro x ranks)."""
    lr: float | None = None
    """Peak learning rate. Default: 1e-3 for --model tiny (trained from scratch), else 5e-7 (DPO paper)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps, then cosine decay to a tenth of --lr at the last step."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means --epochs full passes over the data."""
    epochs: int = 1
    """Passes over the training data, when --max-steps is 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    max_skipped_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm (each skipped on all ranks).
    fp16 steps whose loss is finite but whose gradients overflow only lower the loss scale and do not count."""
    out_dir: str = "runs/dpo"
    """Where metrics.jsonl, checkpoints/ and final/ (the Hugging Face export) go."""
    eval_every: int = 0
    """Evaluate on the held-out set every N steps; 0 means only at the end (and before, with --eval-before)."""
    eval_before: bool = True
    """Also evaluate and sample before the first step: the baseline of the curves and of the demo's scorer share."""
    num_samples: int = 8
    """At each evaluation, complete the first N held-out prompts into {out_dir}/samples.jsonl; 0 disables."""
    sample_max_tokens: int = 64
    """Most new tokens per sampled completion."""
    sample_temperature: float = 0.0
    """0: greedy completions; above 0: sampled at this temperature with a generator seeded by --seed."""
    wandb_project: str | None = None
    """Also log metrics and samples to this Weights & Biases project (needs the wandb package)."""
    save_every: int = 0
    """Save a sharded checkpoint to {out_dir}/checkpoints/step-N every N steps; 0 disables."""
    keep_last: int = 0
    """Keep only the newest K checkpoints; 0 keeps all."""
    resume: str | None = None
    """Resume from a checkpoint folder, or "latest" for {out_dir}/checkpoints/latest."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Hugging Face export in {out_dir}/final; float32 is the master weights as trained."""
    seed: int = 0
    """Seeds the tiny model's init and the data order."""

    def validate(self, world_size: int) -> int:
        """Check the settings against the world size; return the gradient accumulation steps."""
        for name in ("batch_size", "epochs", "max_skipped_steps", "max_steps", "warmup_steps", "eval_every",
                     "save_every", "keep_last", "max_grad_norm", "weight_decay", "num_samples", "sample_max_tokens",
                     "sample_temperature"):
            low = 1 if name in ("batch_size", "epochs", "max_skipped_steps") else 0
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ValueError(f"--batch-size {self.batch_size} must be a multiple of --micro-batch-size "
                             f"({micro}) x {world_size} ranks")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package: pip install wandb")
        self.micro_batch_size = micro
        return self.batch_size // (micro * world_size)


def load_model_config(name: str):
    """(config, tokenizer) for "tiny", a hub id or a local folder: small files, read on every rank."""
    if name == "tiny":  # a ~1M-parameter Llama and ByT5's byte tokenizer: trains on a laptop CPU, needs no files
        tokenizer = load_tokenizer("tiny")
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return config, tokenizer
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ValueError(f"--model {name}: no such folder")
    try:
        return transformers.AutoConfig.from_pretrained(name), load_tokenizer(name)
    except OSError as e:
        raise ValueError(f"--model {name}: cannot load ({str(e).strip().splitlines()[0]})") from None


def load_full_model(name: str, config, seed: int):
    """The whole float32 model on CPU: pretrained weights, or for "tiny" a random init from `seed`."""
    if name == "tiny":
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch.float32)


def build_sharded(config, full_model, cfg: Config, precision, device, frozen: bool = False):
    """Build on the meta device (no memory), checkpoint and shard, then fill from rank 0's `full_model`."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # logits_to_keep hands the output layer a strided slice of the hidden states, for which torch.matmul
    # expands the (V, H) weight to (2B, H, V) and copies it; a contiguous input keeps it one matmul.
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    if cfg.fsdp.activation_checkpointing and not frozen:
        apply_ac(model)
    apply_fsdp(model, precision.mp_policy, device, frozen=frozen, reshard_after_forward=cfg.fsdp.reshard_after_forward)
    load_from_rank0(model, full_model, device)
    return model


# ---------------------------------------------------------------------------------------------- the step
def forward_pairs(policy, reference, batch: dict, objective: LossConfig, ref_logps: torch.Tensor | None = None,
                  tokens_per_pair: float | None = None) -> dict:
    """Per-pair losses, rewards and policy log-probs for one collate_pairs batch: (2B, T) [chosen; rejected].
    ref_logps (2B,), when given (--ref precompute), replaces running `reference`. tokens_per_pair: the whole
    batch's mean chosen tokens per pair, for the NLL term of --loss sft and --sft-weight (see chosen_nll)."""
    if ref_logps is None and reference is not None:  # first, so its logits are freed before the policy's exist
        with torch.no_grad():
            ref_logps = model_logps(reference, batch, objective.average_logps)
    if objective.loss == "sft":  # only the chosen rows train: running the rejected ones too would double the cost
        n = len(batch["input_ids"]) // 2
        chosen = model_logps(policy, {k: v[:n] if torch.is_tensor(v) else v for k, v in batch.items()}, False)
        rejected = torch.zeros_like(chosen)  # not computed; train() drops the metrics that would use it
    else:
        chosen, rejected = model_logps(policy, batch, objective.average_logps).chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2) if ref_logps is not None else (None, None)
    losses, chosen_rewards, rejected_rewards = preference_loss(
        chosen, rejected, ref_chosen, ref_rejected, loss_type=objective.loss, beta=objective.beta,
        label_smoothing=objective.label_smoothing, simpo_gamma=objective.simpo_gamma,
        discopop_tau=objective.discopop_tau)
    nll_weight = 1.0 if objective.loss == "sft" else objective.sft_weight
    if nll_weight:
        tokens = (batch["labels"][: len(chosen), 1:] != IGNORE_INDEX).sum(-1)  # (B,) chosen tokens per row
        summed = chosen * tokens if objective.average_logps else chosen
        losses = losses + nll_weight * chosen_nll(summed, tokens_per_pair)
    return {"losses": losses, "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
            "chosen_logps": chosen.detach(), "rejected_logps": rejected.detach()}


def model_logps(model, batch: dict, average: bool) -> torch.Tensor:
    """(2B,) float32 log-probs of a collate_pairs batch's responses. As every response starts at column
    batch["response_start"], only the columns from the one before it go through the output layer."""
    start = max(batch["response_start"] - 1, 0)  # the last prompt column scores the first response token
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    labels = batch["labels"]
    if _takes_logits_to_keep(type(model)):
        inputs["logits_to_keep"] = labels.shape[1] - start
        labels = labels[:, start:]  # (2B, T - start), aligned with the kept logits
    logits = model(**inputs, use_cache=False).logits  # (2B, T - start, V) in the compute dtype
    return sequence_logps(logits, labels, average)


@functools.cache
def _takes_logits_to_keep(model_class) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _sharded_batches(pairs: list, rank: int, world: int, micro: int, pad_id: int, device):
    """(indices, batch) covering every pair once over all ranks; an empty-index batch is a dummy (see
    build_eval_batches) that keeps every rank's FSDP collectives in step."""
    for idx in build_eval_batches(len(pairs), micro, rank, world):
        yield idx, _to(collate_pairs([pairs[i] for i in idx or [0]], pad_id), device)


@torch.no_grad()
def evaluate(policy, reference, pairs: list, ref_table, cfg: Config, rank: int, world: int, device,
             pad_id: int) -> dict:
    """Means over the whole held-out set, each pair counted once however many ranks there are."""
    policy.eval()
    sums = torch.zeros(len(PAIR_METRICS) + 1, device=device)
    tokens_per_pair = pairs.lengths[:, 1].double().mean().item()
    for idx, batch in _sharded_batches(pairs, rank, world, cfg.micro_batch_size, pad_id, device):
        weight = torch.tensor([1.0] * len(idx) or [0.0], device=device)
        ref_logps = _ref_rows(ref_table, idx or [0])
        out = forward_pairs(policy, reference, batch, cfg.objective, ref_logps, tokens_per_pair)
        sums += torch.cat([pair_sums(out, weight), weight.sum()[None]])
    dist.all_reduce(sums)
    policy.train().reshard()  # see precompute_ref_logps
    return _means(sums[:-1], sums[-1].item(), cfg.objective)


def _means(sums: torch.Tensor, count: float, objective: LossConfig) -> dict:
    """pair_means, less what SFT does not compute: rejected log-probs, so rewards, accuracy and margin."""
    m = pair_means(sums, count)
    return {k: v for k, v in m.items() if k in ("loss", "logps/chosen")} if objective.loss == "sft" else m


@torch.no_grad()
def precompute_ref_logps(model, pairs: list, cfg: Config, rank: int, world: int, device, pad_id: int):
    """(N, 2) float32 [chosen, rejected] reference log-probs of every pair. Each row is computed by one
    rank and is zero on the others, so the sum over ranks is exact."""
    model.eval()
    table = torch.zeros(len(pairs), 2, device=device)
    for idx, batch in _sharded_batches(pairs, rank, world, cfg.micro_batch_size, pad_id, device):
        logps = model_logps(model, batch, cfg.objective.average_logps).view(2, -1).T  # (B, 2)
        table[idx] = logps[:len(idx)]
    dist.all_reduce(table)
    # FSDP2 keeps the root's parameters gathered after a forward (for the backward that usually follows): put
    # the sharded ones back, or the optimizer and checkpoint loading would be handed the gathered copies.
    model.train().reshard()
    return table


def _ref_rows(table, idx: list[int]):
    """(2B,) [chosen; rejected] reference log-probs of pairs `idx` from a precomputed table, or None."""
    return None if table is None else table[idx].T.reshape(-1)


def load_or_precompute_ref(policy, train_tokens, eval_tokens, key: dict, cfg: Config, rank, world, device, pad_id):
    """--ref precompute: reference log-probs for the train and eval sets from the policy's own (still
    untrained) weights, cached as {cache_dir}/ref-<hash>.safetensors under a key of everything they depend on.
    Like checkpoints, the cache needs a file system all ranks share; rank 0 decides whether it is there."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = os.path.join(cfg.cache_dir, f"ref-{digest}.safetensors")
    hit = torch.tensor(float(rank == 0 and os.path.exists(path)), device=device)
    dist.broadcast(hit, src=0)
    if hit.item():
        say(f"reference log-probs: {path} (cached)")
        tables = safetensors.torch.load_file(path, device=str(device))
        return tables["train"], tables["eval"]
    t0 = time.perf_counter()
    train = precompute_ref_logps(policy, train_tokens, cfg, rank, world, device, pad_id)
    evals = precompute_ref_logps(policy, eval_tokens, cfg, rank, world, device, pad_id)
    if rank == 0:
        os.makedirs(cfg.cache_dir, exist_ok=True)
        safetensors.torch.save_file({"train": train.cpu(), "eval": evals.cpu()}, path + ".tmp",
                                    metadata={"key": json.dumps(key, default=str)})
        os.replace(path + ".tmp", path)
    say(f"reference log-probs: computed {len(train_tokens) + len(eval_tokens)} pairs in "
        f"{time.perf_counter() - t0:.1f} s, cached at {path}")
    return train, evals


def _model_identity(name: str, config, seed: int) -> dict:
    """What fixes a model's initial weights: the seed for tiny; else the name, the hub commit, the weight files."""
    if name == "tiny":
        return {"tiny": seed, "config": config.to_dict()}
    folder = os.path.expanduser(name)
    files = sorted((f, os.path.getsize(os.path.join(folder, f)), os.path.getmtime(os.path.join(folder, f)))
                   for f in os.listdir(folder) if f.endswith((".safetensors", ".bin"))) if os.path.isdir(folder) else []
    return {"name": name, "commit": getattr(config, "_commit_hash", None), "files": files}


def get_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """1) linear warmup to peak over `warmup` steps; 2) cosine decay to peak/10 at the last step."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(total - 1 - warmup, 1)
    return peak / 10 + (peak - peak / 10) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# ---------------------------------------------------------------------------------------------- main
# What makes two runs the same run: resuming with any of these changed is refused. Everything else may change
# on resume (--max-steps, --epochs, --lr, --warmup-steps, precision, ...); the LR schedule follows the new values.
_SAME_RUN = {"model": "--model", "data": "--data", "data_sha256": "the content of --data", "seed": "--seed",
             "eval_fraction": "--eval-fraction", "batch_size": "--batch-size", "max_length": "--max-length",
             "max_prompt_length": "--max-prompt-length", "truncation": "--truncation", "loss": "--loss",
             "beta": "--beta", "label_smoothing": "--label-smoothing", "simpo_gamma": "--simpo-gamma",
             "discopop_tau": "--discopop-tau", "sft_weight": "--sft-weight"}


def _raise_config_error(event) -> None:
    """A config's own ValueError (e.g. --max-prompt-length not below --max-length) reaches main() as one line,
    instead of tyro's multi-line box. (tyro._errors is tyro's experimental hook; tyro is pinned.)"""
    if isinstance(event, tyro._errors.InstantiationFailure) and event.argument is None:  # not a bad value's
        raise ValueError(event.message)


def main(argv: list[str] | None = None) -> None:
    transformers.utils.logging.disable_progress_bar()
    try:  # repeated --data / --eval-data flags append
        with tyro._errors.on_parse_error(_raise_config_error):
            cfg = tyro.cli(Config, args=argv, config=(tyro.conf.UseAppendAction,))
    except ValueError as e:
        say(f"error: {e}")
        sys.exit(2)
    try:
        rank, world, device = init_distributed(cfg.fsdp.device)
    except ValueError as e:
        say(f"error: {e}")
        sys.exit(2)
    try:
        code = train(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def train(cfg: Config, rank: int, world: int, device) -> int:
    """Everything that needs the process group. Returns the exit code."""
    if device.type == "cuda":  # peak_mem_gb is this run's, also after an earlier run in this process
        torch.cuda.reset_peak_memory_stats(device)
    # -- precision, data (read and tokenized by rank 0 only, cached, memory-mapped by all)
    try:
        accum = cfg.validate(world)
        precision = resolve_precision(cfg.mixed_precision, device)
        if precision.warning:
            say(f"warning: {precision.warning}")
        config, tokenizer = load_model_config(cfg.model)
        max_positions = getattr(config, "max_position_embeddings", None)
        if max_positions and cfg.dataset.max_length > max_positions:
            raise ValueError(f"--max-length {cfg.dataset.max_length} exceeds the model's {max_positions} positions")
        data_cfg = cfg.dataset
        demo = data_cfg.data in ((), ("demo",), ("demo:sft",))
        if demo:  # the demo, written out as files: it takes the same path as user data
            demo_train, demo_eval, demo_sft = write_demo(cfg.cache_dir)
            evals = data_cfg.eval_data or (() if data_cfg.eval_fraction else (demo_eval,))
            data_cfg = replace(data_cfg, data=(demo_sft if data_cfg.data == ("demo:sft",) else demo_train,),
                               eval_data=evals)
        train_tokens, eval_tokens, data_summary = prepare_data(data_cfg, tokenizer, cfg.cache_dir)
        steps_per_epoch = len(train_tokens) // cfg.batch_size
        if steps_per_epoch == 0:
            raise ValueError(f"{','.join(cfg.dataset.data)}: {len(train_tokens)} pairs, fewer than one "
                             f"--batch-size ({cfg.batch_size})")
        data_sha256 = data_summary["train_sha256"]
        ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
        resume_path = find_checkpoint(ckpt_root, cfg.resume) if cfg.resume else None
        saved = read_trainer_state(resume_path) if resume_path else None
        if saved:
            current = json.loads(json.dumps({"config": asdict(cfg), "data_sha256": data_sha256}))  # tuples as saved
            check_same_run(saved, current, _SAME_RUN)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    cfg.lr = lr = cfg.lr if cfg.lr is not None else (1e-3 if cfg.model == "tiny" else 5e-7)

    # -- models: only rank 0 loads the full weights; the reference is a frozen copy, sharded the same way
    full_model = load_full_model(cfg.model, config, cfg.seed) if rank == 0 else None
    policy = build_sharded(config, full_model, cfg, precision, device).train()
    online_ref = not cfg.objective.reference_free and cfg.ref == "online"
    reference = build_sharded(config, full_model, cfg, precision, device, frozen=True) if online_ref else None
    del full_model
    rss = host_memory_by_rank_gb(device)
    ref_train = ref_eval = None
    if not cfg.objective.reference_free and cfg.ref == "precompute":  # before any checkpoint replaces the weights
        key = {"model": _model_identity(cfg.model, config, cfg.seed), "data": data_summary["fingerprint"],
               "average": cfg.objective.average_logps, "precision": precision.name}
        ref_train, ref_eval = load_or_precompute_ref(policy, train_tokens, eval_tokens, key, cfg, rank, world,
                                                     device, pad_id)

    # -- optimizer: AdamW over the float32 sharded master weights; then the checkpoint, if resuming
    # fused: one kernel over all parameters (4x faster than the per-tensor loop on a 60M model on CPU).
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=True)
    scaler, start_step = precision.scaler, saved["step"] if saved else 0
    if saved:
        same_rng = load_checkpoint(resume_path, policy, optimizer)
        if scaler and saved["scaler"]:
            scaler.load_state_dict(saved["scaler"])
        say(f"resumed from {resume_path} at step {start_step}" + (
            "" if same_rng else f" (saved on {saved['world_size']} ranks: random generators not restored)"))
    os.makedirs(cfg.out_dir, exist_ok=True)
    metrics_file = open_log(os.path.join(cfg.out_dir, "metrics.jsonl"), start_step) if rank == 0 else None
    say(f"{cfg.model}: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params, {world} rank(s) on "
         f"{device} ({dist.get_backend()}), {precision.name}, {len(train_tokens)} train / {len(eval_tokens)} eval "
         f"pairs, {total_steps} steps x {cfg.batch_size} pairs ({accum} accumulation steps); peak host memory after "
         f"loading, GB by rank: {' '.join(f'{x:.2f}' for x in rss)}")
    sample_prompts = [eval_tokens[i]["prompt"] for i in range(min(cfg.num_samples, len(eval_tokens)))]
    samples_path = os.path.join(cfg.out_dir, "samples.jsonl")
    samples_file = open_log(samples_path, start_step) if rank == 0 and sample_prompts else None
    wandb_run = open_wandb(cfg.wandb_project, asdict(cfg), cfg.out_dir) if rank == 0 and cfg.wandb_project else None

    def log(row: dict, samples: list | None = None) -> None:
        for f, rows in ((metrics_file, [row]), (samples_file, samples or [])):
            if f:  # line-buffered: each row reaches the disk as it is written
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if wandb_run:
            wandb_run.log(row, samples)

    for split in ("train", "eval"):
        d = data_summary[split]
        if start_step == 0:
            log({"step": 0, "split": f"data/{split}", **{k: v for k, v in d.items() if not isinstance(v, dict)}})
        if d["pairs"] or d["dropped"]:
            say(f"{split} data: {d['pairs']} pairs; dropped {d['dropped']} (empty response {d['dropped_empty']}, "
                f"identical {d['dropped_identical']}); truncated {d['truncated']} (prompts {d['truncated_prompts']}, "
                f"responses {d['truncated_responses']})")
    if not eval_tokens:
        say("no --eval-data or --eval-fraction: evaluation skipped")

    def run_eval(step: int) -> None:
        if not eval_tokens:
            return
        m = evaluate(policy, reference, eval_tokens, ref_eval, cfg, rank, world, device, pad_id)
        samples = []
        if sample_prompts:  # every rank generates (FSDP needs them all); rank 0 writes
            completions = generate(policy, sample_prompts, cfg.sample_max_tokens, tokenizer.eos_token_id, pad_id,
                                   cfg.sample_temperature, cfg.seed)
            policy.reshard()  # see precompute_ref_logps
            text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            samples = [{"step": step, "prompt": text(p), "completion": text(c)}
                       for p, c in zip(sample_prompts, completions)]
            if demo:  # the demo's ground truth: the share of completions in the chosen (and the rejected) style
                scores = [score_completion(s["completion"]) for s in samples]
                m["samples/preferred"] = scores.count(1) / len(scores)
                m["samples/rejected_style"] = scores.count(-1) / len(scores)
        log({"step": step, "split": "eval", **m, "elapsed_s": time.perf_counter() - t0}, samples)
        say(f"eval at step {step} ({len(eval_tokens)} pairs): loss {m['loss']:.4f}"
            + (f" reward accuracy {m['rewards/accuracies']:.3f} margin {m['rewards/margins']:.3f}"
               if "rewards/margins" in m else "")
            + (f" | demo scorer prefers {m['samples/preferred']:.0%} of samples" if "samples/preferred" in m else "")
            + (f" | {samples[0]['prompt']!r} -> {samples[0]['completion']!r}" if samples else ""))

    def save(step: int) -> str:
        extra = {"step": step, "config": asdict(cfg), "data_sha256": data_sha256,
                 "data_position": {"epoch": step // steps_per_epoch,
                                   "pairs_consumed": step % steps_per_epoch * cfg.batch_size},
                 "schedule": {"lr": lr, "warmup_steps": cfg.warmup_steps, "total_steps": total_steps},
                 "scaler": scaler.state_dict() if scaler else None}
        return save_checkpoint(ckpt_root, step, policy, optimizer, extra, keep_last=cfg.keep_last)

    # -- loop
    n_params = sum(p.numel() for p in policy.parameters())
    peak_flops = device_peak_flops(torch.cuda.get_device_name(device), precision.name) if device.type == "cuda" else None
    t0 = time.perf_counter()
    stop = StopRequest()  # SIGTERM / SIGINT: finish this step, checkpoint it, exit
    batches, epoch, bad_steps = [], -1, 0
    nll = cfg.objective.loss == "sft" or cfg.objective.sft_weight > 0
    if start_step == 0 and cfg.eval_before:
        run_eval(0)  # the baseline: where the samples and the metrics start
    for step in range(start_step, total_steps):
        if step // steps_per_epoch != epoch:  # the data order is a function of (seed, epoch) only
            epoch = step // steps_per_epoch
            lengths = pair_lengths(train_tokens) if cfg.dataset.group_by_length else None
            batches = build_batches(len(train_tokens), cfg.batch_size, rank, world, cfg.seed, epoch, lengths)
            # The NLL is a token mean over the whole batch: every rank counts the global batch's chosen tokens.
            whole = build_batches(len(train_tokens), cfg.batch_size, 0, 1, cfg.seed, epoch, lengths) if nll else None
        chosen_tokens = train_tokens.lengths[whole[step % steps_per_epoch], 1] if nll else None
        tokens_per_pair = chosen_tokens.double().mean().item() if nll else None
        step_t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, lr, cfg.warmup_steps, total_steps)
        mine = batches[step % steps_per_epoch]
        sums = torch.zeros(len(PAIR_METRICS) + 2, device=device)  # the metrics, non-padding and all tokens
        for micro in range(accum):
            idx = mine[micro * cfg.micro_batch_size:(micro + 1) * cfg.micro_batch_size]
            batch = _to(collate_pairs([train_tokens[i] for i in idx], pad_id), device)
            # By default every micro-batch's gradient is reduce-scattered at once, so no rank holds a full one.
            policy.set_requires_gradient_sync(not cfg.fsdp.unsharded_grad_accumulation or micro == accum - 1)
            out = forward_pairs(policy, reference, batch, cfg.objective, _ref_rows(ref_train, idx), tokens_per_pair)
            # Per-rank sum / per-rank batch; FSDP averages over ranks: the mean over the global batch.
            loss = out["losses"].sum() / (cfg.batch_size // world)
            (scaler.scale(loss) if scaler else loss).backward()
            ones = torch.ones(len(idx), device=device)
            mask = batch["attention_mask"][:len(idx) if cfg.objective.loss == "sft" else None]  # rows forwarded
            sums += torch.cat([pair_sums(out, ones), mask.sum()[None], torch.full((1,), mask.numel(), device=device)])
        dist.all_reduce(sums)  # one collective per step for the metrics; one more for maxima:
        peaks = torch.tensor([peak_memory_gb(device), float(stop.signum > 0)], device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the fullest rank's memory; whether any rank must stop
        # A global norm and loss: a NaN or an fp16 overflow on any rank skips the step on all of them.
        grad_norm, skipped = clip_and_step(policy, optimizer, scaler, cfg.max_grad_norm, loss_sum=sums[0])
        dt = time.perf_counter() - step_t0
        m = _means(sums[:-2], cfg.batch_size, cfg.objective)
        # A finite loss whose fp16 gradients overflow is the scaler searching for its scale, not a broken run,
        # until the scale is below 1, where halving it is no longer the cure.
        searching = scaler is not None and math.isfinite(m["loss"]) and scaler.get_scale() >= 1
        bad_steps = 0 if not skipped else bad_steps + (not searching)
        tokens = sums[-2].item()
        m.update({"grad_norm": grad_norm.item(), "lr": optimizer.param_groups[0]["lr"],
                  "tokens_per_s": tokens / dt, "pairs_per_s": cfg.batch_size / dt,
                  "padding_efficiency": tokens / sums[-1].item(), "peak_mem_gb": peaks[0].item(),
                  "elapsed_s": time.perf_counter() - t0, "skipped": skipped})
        if scaler:
            m["loss_scale"] = scaler.get_scale()
        if peak_flops:  # model FLOPs: 6N per token for the policy's forward and backward, 2N for an online reference
            m["mfu"] = (6 + 2 * online_ref) * n_params * tokens / dt / (world * peak_flops)
        log({"step": step + 1, "split": "train", **m})
        if skipped:
            say(f"step {step + 1}: non-finite loss or gradient norm, step skipped on every rank")
        if bad_steps >= cfg.max_skipped_steps:
            say(f"error: stopping at step {step + 1}: {bad_steps} consecutive steps since step "
                 f"{step + 2 - bad_steps} had a non-finite loss or gradient norm")
            return 1
        show_progress(step + 1, total_steps, m)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total_steps:
            run_eval(step + 1)
        stopping = peaks[1].item() > 0
        if stopping or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            path = save(step + 1)
        if stopping:
            say(f"stopped by a signal after step {step + 1}: saved {path}; continue with --resume latest")
            return 128 + (stop.signum or signal.SIGTERM)
    stop.restore()

    # -- final evaluation and export
    run_eval(total_steps)
    rss = host_memory_by_rank_gb(device)
    state = gather_full_state_dict(policy, getattr(torch, cfg.export_dtype))
    if rank == 0:
        say("peak host memory during training, GB by rank: " + " ".join(f"{x:.2f}" for x in rss))
        final = os.path.join(cfg.out_dir, "final")
        policy.save_pretrained(final, state_dict=state)
        policy.config.dtype = getattr(torch, cfg.export_dtype)  # save_pretrained records the masters' dtype
        policy.config.save_pretrained(final)
        tokenizer.save_pretrained(final)
        with open(os.path.join(final, "train_config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        for f in (metrics_file, samples_file):
            if f:
                f.close()
        say(f"saved {final}")
        if not plot_metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "metrics.png")):
            say("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        if wandb_run:
            wandb_run.finish()
    dist.barrier()
    return 0


if __name__ == "__main__":
    main()
