"""DPO training with FSDP2 mixed precision. One code path for 1..N ranks.

    python train_dpo.py                                   # tiny model, built-in demo data, CPU is fine
    torchrun --nproc_per_node=8 train_dpo.py --precision bf16 --model <hub id or dir> --data prefs.jsonl

Reads top to bottom: config; setup (data, steps, resume); models; the step and evaluation; the loop; export.
"""

import importlib.util
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

from batches import build_batches, eval_batches, micro_batches, pair_lengths, rank_share, to_device
from checkpoint import (CheckpointConfig, StopRequest, check_same_run, find_checkpoint, finish_checkpoint,
                        load_checkpoint, read_trainer_state, save_checkpoint)
from data import (DataConfig, PairTokens, key_digest, load_tokenizer, load_tokens, tokenize_to_cache, write_atomic,
                  write_jsonl)
from demo import demo_pairs, score_completion
from fsdp_setup import (FSDPConfig, build_sharded, find_block_class, inference, init_distributed, on_rank0, save_files,
                        save_pretrained)
from lora import LoraConfig, WithoutAdapters, add_adapters, check_mergeable, gather_adapters, merge_adapters
from loss import LossConfig, forward_pairs, model_logps
from metrics import (PAIR_METRICS, RunLog, flop_coefficients, forward_flops, host_memory_by_rank_gb, mfu, pair_means,
                     pair_sums, peak_memory_gb, say, show_progress, step_metrics)
from precision import Precision, PrecisionConfig, clip_and_step, resolve_precision, skip_counts
from samples import SampleConfig, sample_completions


# ---------------------------------------------------------------------------------------------- config
@dataclass
class Config:
    model: str = "tiny"
    """Hub id, local folder, or "tiny" (random-init Llama, byte tokenizer, no download). Reference: a frozen copy
    (with --lora-rank: the same model, adapters off)."""
    dataset: Annotated[DataConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=DataConfig)
    objective: Annotated[LossConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=LossConfig)
    mixed_precision: Annotated[PrecisionConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=PrecisionConfig)
    fsdp: Annotated[FSDPConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=FSDPConfig)
    lora: Annotated[LoraConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=LoraConfig)
    sampling: Annotated[SampleConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=SampleConfig)
    checkpoints: Annotated[CheckpointConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=CheckpointConfig)
    ref: Literal["online", "precompute"] = "online"
    """online: a frozen reference model runs every batch. precompute: one pass caches all reference log-probs first
    (no second model in memory; for >1 epoch or tight memory)."""
    batch_size: int = 32
    """Global preference pairs per optimizer step, over all ranks and accumulation steps."""
    micro_batch_size: int | None = None
    """Pairs per rank per forward (2x rows). Default: batch-size / ranks. Accumulation = batch / (micro x ranks)."""
    lr: float | None = None
    """Peak learning rate. Default: 1e-3 for --model tiny (trained from scratch), else 5e-7 (DPO paper), or 5e-6
    with --lora-rank (TRL's LoRA DPO example)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps, then cosine decay to a tenth of --lr at the last step."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means --epochs full passes over the data."""
    epochs: int = 1
    """Passes over the training data, when --max-steps is 0."""
    out_dir: str = "runs/dpo"
    """Where metrics.jsonl, checkpoints/ and final/ (the Hugging Face export) go."""
    eval_every: int = 0
    """Evaluate on the held-out set every N steps; 0 means only at the end (and before, with --eval-before)."""
    eval_before: bool = True
    """Also evaluate and sample before the first step: the baseline of the curves and of the demo's scorer share."""
    wandb_project: str | None = None
    """Also log metrics and samples to this Weights & Biases project (needs the wandb package)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the Hugging Face export in {out_dir}/final; float32 is the master weights as trained."""
    seed: int = 0
    """Seeds the tiny model's init and the data order."""
    dropout: bool = False
    """Keep the model's dropout on in the policy while training. Off by default (as in TRL): dropout makes the
    policy's log-probs noisy against the reference's, which runs without it, and the first loss would not be ln 2."""

    def validate(self, world_size: int) -> None:
        """Check the settings against the world size; raises ValueError naming the flag."""
        for name in ("batch_size", "epochs", "max_steps", "warmup_steps", "eval_every", "weight_decay"):
            low = 1 if name in ("batch_size", "epochs") else 0
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ValueError(f"--batch-size {self.batch_size} must be a multiple of --micro-batch-size "
                             f"({micro}) x {world_size} ranks")
        if world_size % self.fsdp.replicas:
            raise ValueError(f"--replicas {self.fsdp.replicas} does not divide the {world_size} ranks")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package: pip install wandb")
        if self.lora.lora_rank and importlib.util.find_spec("peft") is None:
            raise ValueError("--lora-rank needs the peft package: pip install peft")
        if self.lora.lora_dropout and not self.dropout:  # the policy trains in eval mode without --dropout
            raise ValueError("--lora-dropout needs --dropout: dropout runs only in train mode, which --dropout turns "
                             "on (the model's own dropout too, where its config has any)")


# What makes two runs the same run: resuming with any of these changed is refused. Everything else may change
# on resume (--max-steps, --epochs, --lr, --warmup-steps, precision, ...); the LR schedule follows the new values.
_SAME_RUN = {"model": "--model", "data": "--data", "data_sha256": "the tokenized --data (its content, cut by this "
             "code)", "seed": "--seed",
             "eval_fraction": "--eval-fraction", "batch_size": "--batch-size", "max_length": "--max-length",
             "max_prompt_length": "--max-prompt-length", "truncation": "--truncation",
             "group_by_length": "--group-by-length", "loss": "--loss", "beta": "--beta",
             "label_smoothing": "--label-smoothing", "simpo_gamma": "--simpo-gamma", "discopop_tau": "--discopop-tau",
             "sft_weight": "--sft-weight", "average_logps": "mean log-probs (--ipo-logps)", "lora_rank": "--lora-rank",
             "lora_alpha": "--lora-alpha", "lora_targets": "--lora-targets"}


# ---------------------------------------------------------------------------------------------- setup
@dataclass
class Run:
    """What setup_run decides, once. cfg is a resolved copy (lr, micro_batch_size); the parsed one never changes."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    precision: Precision
    model_config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase
    train: PairTokens
    eval: PairTokens
    data: dict  # the tokenized data's summary: fingerprint, sha256, counts
    demo: bool  # the built-in demo, whose samples have a ground-truth scorer
    steps_per_epoch: int
    total_steps: int
    saved: dict | None  # the trainer state of the checkpoint to resume, with its "path"
    _epochs: dict = field(default_factory=dict, repr=False)

    def batch(self, step: int) -> list[int]:
        """The pair indices of `step`'s global batch; each epoch's order is a function of (seed, epoch) only."""
        epoch = step // self.steps_per_epoch
        if epoch not in self._epochs:
            lengths = pair_lengths(self.train.lengths) if self.cfg.dataset.group_by_length else None
            self._epochs = {epoch: build_batches(len(self.train), self.cfg.batch_size, self.cfg.seed, epoch, lengths)}
        return self._epochs[epoch][step % self.steps_per_epoch]

    start_step = property(lambda self: self.saved["step"] if self.saved else 0)
    pack_length = property(lambda self: self.cfg.dataset.max_length if self.cfg.dataset.packing else 0)
    pad_id = property(lambda self: self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                      else self.tokenizer.eos_token_id)
    # What the loss computes: SFT runs no rejected rows, so it has no rewards, accuracy or margin.
    metric_keys = property(lambda self: PAIR_METRICS if self.cfg.objective.pairwise else ("loss", "logps/chosen"))


def setup_run(cfg: Config, rank: int, world: int, device: torch.device) -> Run:
    """Validate the config and resolve its defaults, read (rank 0 tokenizes) the data, read the resume state.
    Raises ValueError, naming the flag or the file, for anything the user must fix."""
    cfg.validate(world)
    lr = cfg.lr if cfg.lr is not None else 1e-3 if cfg.model == "tiny" else 5e-6 if cfg.lora.lora_rank else 5e-7
    cfg = replace(cfg, lr=lr, micro_batch_size=cfg.micro_batch_size or cfg.batch_size // world)
    precision = resolve_precision(cfg.mixed_precision, device)
    if precision.warning:
        say(f"warning: {precision.warning}")
    model_config, tokenizer = load_model_config(cfg.model)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions and cfg.dataset.max_length > max_positions:
        raise ValueError(f"--max-length {cfg.dataset.max_length} exceeds the model's {max_positions} positions")
    if cfg.dataset.packing:  # loss._document_mask: full causal attention within each sequence
        _check_packing(model_config, cfg.dataset.max_length)
    if cfg.lora.lora_rank:  # a bad --lora-targets fails here, before rank 0 loads any weights
        with torch.device("meta"):
            probe = adapt(cfg, transformers.AutoModelForCausalLM.from_config(model_config))
        if cfg.lora.export_merged:
            check_mergeable(probe)
    demo = cfg.dataset.data in ((), ("demo",), ("demo:sft",))
    data_cfg = _demo_data(cfg) if demo else cfg.dataset
    train, evals, data = load_tokens(on_rank0(lambda: tokenize_to_cache(data_cfg, tokenizer, say)))
    if len(train) < cfg.batch_size:
        raise ValueError(f"{','.join(cfg.dataset.data)}: {len(train)} pairs, fewer than one --batch-size "
                         f"({cfg.batch_size})")
    saved = None
    if cfg.checkpoints.resume:
        path = find_checkpoint(os.path.join(cfg.out_dir, "checkpoints"), cfg.checkpoints.resume)
        saved = {**read_trainer_state(path), "path": path}
        saved["config"].setdefault("lora", asdict(LoraConfig()))  # saved before LoRA existed: full fine-tuning
        current = json.loads(json.dumps(_identity(cfg, data)))  # tuples as saved
        check_same_run(saved, current, _SAME_RUN)
    steps_per_epoch = len(train) // cfg.batch_size
    return Run(cfg, rank, world, device, precision, model_config, tokenizer, train, evals, data, demo,
               steps_per_epoch, cfg.max_steps or cfg.epochs * steps_per_epoch, saved)


def _identity(cfg: Config, data: dict) -> dict:
    """What a checkpoint records of its run, for check_same_run: the config and what it implies."""
    return {"config": asdict(cfg), "data_sha256": data["train_sha256"], "average_logps": cfg.objective.average_logps}


def _demo_data(cfg: Config) -> DataConfig:
    """The demo, written out by rank 0 as JSON Lines files: it then takes the same path as user data."""
    path = lambda split: os.path.join(cfg.dataset.cache_dir, f"demo-{split}.jsonl")
    files = on_rank0(lambda: {s: path(s) if os.path.exists(path(s)) else write_jsonl(path(s), demo_pairs(s))
                              for s in ("train", "eval", "sft")})
    evals = cfg.dataset.eval_data or (() if cfg.dataset.eval_fraction else (files["eval"],))
    train = files["sft" if cfg.dataset.data == ("demo:sft",) else "train"]
    return replace(cfg.dataset, data=(train,), eval_data=evals)


# ---------------------------------------------------------------------------------------------- models
@dataclass
class Models:
    policy: torch.nn.Module
    reference: torch.nn.Module | None  # None with --ref precompute or a reference-free loss; LoRA: the policy's base
    ref_train: torch.Tensor | None  # (N, 2) summed [chosen, rejected] reference log-probs, with --ref precompute
    ref_eval: torch.Tensor | None
    load_rss: list[float]  # every rank's peak host memory (GB) once the models were loaded
    flops: tuple[float, float, float]  # the policy's (and reference's) metrics.flop_coefficients


def build_models(run: Run) -> Models:
    """The policy and (--ref online) a frozen reference, sharded the same way; only rank 0 loads the weights.
    With --ref precompute: the reference log-probs instead, from the policy before any checkpoint is loaded.
    With --lora-rank the policy carries the adapters, and its base (adapters off) is the reference."""
    cfg = run.cfg
    make = lambda: adapt(cfg, transformers.AutoModelForCausalLM.from_config(run.model_config, dtype=torch.float32))
    build = lambda *a, **k: build_sharded(make, *a, run.precision.mp_policy, run.device, cfg.fsdp, **k)
    # Rank 0 alone loads the weights (None elsewhere); the others wait outside any collective, however long.
    full_model = on_rank0(lambda: adapt(cfg, load_full_model(cfg.model, run.model_config, cfg.seed)), share=False)
    policy = build(full_model).train(cfg.dropout)  # eval mode is what turns dropout off; gradients flow the same
    online = not cfg.objective.reference_free and cfg.ref == "online"
    reference = (WithoutAdapters(policy) if cfg.lora.lora_rank else build(full_model, frozen=True)) if online else None
    del full_model
    rss = host_memory_by_rank_gb(run.device)
    precompute = not cfg.objective.reference_free and cfg.ref == "precompute"
    tables = load_or_precompute_ref(run, policy) if precompute else (None, None)
    return Models(policy, reference, *tables, rss, flop_coefficients(policy))


def adapt(cfg: Config, model):
    """`model` with --lora-rank's adapters (a peft model whose base is frozen), or as it is (full fine-tuning)."""
    return add_adapters(model, cfg.lora, find_block_class(model), cfg.seed) if cfg.lora.lora_rank else model


def _check_packing(config, max_length: int) -> None:
    """--packing's mask replaces the model's own: refuse attention kinds it cannot stand in for."""
    attention = config._attn_implementation or "sdpa"  # None: transformers' default, sdpa where it can
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"--packing needs sdpa or eager attention, not {attention!r}")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < max_length:
        raise ValueError(f"--packing: the model attends within a sliding window of {window} tokens, shorter than "
                         f"--max-length {max_length}; the packing mask would drop it")


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


# ---------------------------------------------------------------------------------------------- the step
def train_step(run: Run, models: Models, batch: list[int]) -> torch.Tensor:
    """Forward and backward over this rank's share of the global `batch` (pair indices), micro-batch by
    micro-batch. Returns this rank's sums, not yet reduced: PAIR_METRICS, non-padding and all tokens, FLOPs."""
    cfg, scaler, flops = run.cfg, run.precision.scaler, 0.0
    sums = torch.zeros(len(PAIR_METRICS) + 3, device=run.device)
    # The NLL is a token mean over the whole global batch, whichever rank and micro-batch a pair is in.
    tokens_per_pair = run.train.mean_chosen(batch) if cfg.objective.nll_weight else None
    mine = rank_share(batch, run.rank, run.world)
    micros = micro_batches(run.train, mine, cfg.micro_batch_size, run.pad_id, run.device, run.pack_length)
    for i, (idx, micro) in enumerate(micros):
        # By default every micro-batch's gradient is reduce-scattered at once, so no rank holds a full one.
        last = (i + 1) * cfg.micro_batch_size >= len(mine)
        models.policy.set_requires_gradient_sync(not cfg.fsdp.unsharded_grad_accumulation or last)
        out = forward_pairs(models.policy, models.reference, micro, cfg.objective, _ref_rows(models.ref_train, idx),
                            tokens_per_pair)
        # Per-rank sum / per-rank batch; FSDP averages over ranks: the mean over the global batch.
        loss = out["losses"].sum() / len(mine)
        (scaler.scale(loss) if scaler else loss).backward()
        sums[:-1] += torch.cat([pair_sums(out, torch.ones(len(idx), device=run.device)), out["tokens"]])
        flops += _flops(models, micro, cfg)
    sums[-1] = flops  # a host number: computed from shapes, so no sync
    return sums


def _flops(models: Models, micro: dict, cfg: Config) -> float:
    """Model FLOPs of a micro-batch: the policy's forward and backward (SFT: chosen rows only), the reference's
    forward. LoRA's backward computes no gradient of the frozen weights: one forward's worth, not two."""
    rows, length = micro["input_ids"].shape
    scored = len(micro["score_index"])
    pairwise = cfg.objective.pairwise
    policy = (rows, length, scored) if pairwise else (micro["chosen_rows"], length, micro["chosen_scored"])
    reference = forward_flops(models.flops, rows, length, scored) if models.reference is not None else 0
    return (2 if cfg.lora.lora_rank else 3) * forward_flops(models.flops, *policy) + reference


def _ref_rows(table: torch.Tensor | None, idx: list[int]) -> torch.Tensor | None:
    """(2B,) [chosen; rejected] reference log-probs of pairs `idx` from a precomputed table, or None."""
    return None if table is None else table[to_device(torch.tensor(idx), table.device)].T.reshape(-1)


def evaluate(run: Run, models: Models) -> dict:
    """Means over the whole held-out set, each pair counted once however many ranks there are."""
    sums, tokens_per_pair = torch.zeros(len(PAIR_METRICS) + 1, device=run.device), run.eval.mean_chosen()
    with inference(models.policy):
        for idx, batch in eval_batches(run.eval, run.cfg.micro_batch_size, run.rank, run.world, run.pad_id,
                                       run.device, run.pack_length):
            weight = torch.full((max(len(idx), 1),), float(bool(idx)), device=run.device)  # 0: a dummy batch
            out = forward_pairs(models.policy, models.reference, batch, run.cfg.objective,
                                _ref_rows(models.ref_eval, idx or [0]), tokens_per_pair)
            sums += torch.cat([pair_sums(out, weight), weight.sum()[None]])
    dist.all_reduce(sums)
    return pair_means(sums[:-1], sums[-1].item(), run.metric_keys)


def evaluate_and_sample(run: Run, models: Models, log: RunLog, step: int, t0: float) -> None:
    """Evaluate on the held-out set, complete its first --num-samples prompts, log both and show one line."""
    if not len(run.eval):
        return
    m, samples = evaluate(run, models), []
    prompts = [run.eval[i]["prompt"] for i in range(min(run.cfg.sampling.num_samples, len(run.eval)))]
    if prompts:  # every rank generates (FSDP needs them all); rank 0 writes
        with inference(models.policy):
            samples = [{"step": step, **s} for s in sample_completions(models.policy, run.tokenizer, prompts,
                                                                          run.cfg.sampling, run.pad_id, run.cfg.seed)]
        if run.demo:  # the demo's ground truth: the share of completions in the chosen (and the rejected) style
            scores = [score_completion(s["completion"]) for s in samples]
            m["samples/preferred"] = scores.count(1) / len(scores)
            m["samples/rejected_style"] = scores.count(-1) / len(scores)
    log.write({"step": step, "split": "eval", **m, "elapsed_s": time.perf_counter() - t0}, samples)
    say(f"eval at step {step} ({len(run.eval)} pairs): loss {m['loss']:.4f}"
        + (f" reward accuracy {m['rewards/accuracies']:.3f} margin {m['rewards/margins']:.3f}"
           if "rewards/margins" in m else "")
        + (f" | demo scorer prefers {m['samples/preferred']:.0%} of samples" if "samples/preferred" in m else "")
        + (f" | {samples[0]['prompt']!r} -> {samples[0]['completion']!r}" if samples else ""))


def load_or_precompute_ref(run: Run, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """--ref precompute: (N, 2) summed [chosen, rejected] reference log-probs of the train and eval pairs, from
    the policy's own (still untrained; LoRA: adapters off) weights, cached as {cache_dir}/ref-<hash>.safetensors under a key of
    everything they depend on. The cache needs a file system all ranks share; rank 0 decides if it is there."""
    key = {"model": _model_identity(run.cfg.model, run.model_config, run.cfg.seed), "data": run.data["fingerprint"],
           "precision": run.precision.name}
    path = os.path.join(run.cfg.dataset.cache_dir, f"ref-{key_digest(key)[:20]}.safetensors")
    if on_rank0(lambda: os.path.exists(path)):
        say(f"reference log-probs: {path} (cached)")
        tables = safetensors.torch.load_file(path, device=str(run.device))
        return tables["train"], tables["eval"]
    t0, tables = time.perf_counter(), {}
    reference = WithoutAdapters(policy) if run.cfg.lora.lora_rank else policy
    for split, pairs in (("train", run.train), ("eval", run.eval)):
        tables[split] = torch.zeros(len(pairs), 2, device=run.device)  # each row from one rank, 0 on the others
        with inference(policy):
            for idx, batch in eval_batches(pairs, run.cfg.micro_batch_size, run.rank, run.world, run.pad_id,
                                           run.device, run.pack_length):
                tables[split][idx] = model_logps(reference, batch).view(2, -1).T[:len(idx)]  # (B, 2)
        dist.all_reduce(tables[split])  # so the sum over ranks is exact
    if run.rank == 0:
        write_atomic(path, lambda tmp: safetensors.torch.save_file(
            {k: v.cpu() for k, v in tables.items()}, tmp, metadata={"key": json.dumps(key, default=str)}))
    say(f"reference log-probs: computed {len(run.train) + len(run.eval)} pairs in {time.perf_counter() - t0:.1f} s, "
        f"cached at {path}")
    return tables["train"], tables["eval"]


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


# ---------------------------------------------------------------------------------------------- the loop
def train(cfg: Config, rank: int, world: int, device: torch.device) -> int:
    """Everything that needs the process group. Returns the exit code."""
    try:
        run = setup_run(cfg, rank, world, device)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    cfg, models = run.cfg, build_models(run)  # the resolved config from here on
    optimizer, scaler = build_optimizer(run, models.policy), run.precision.scaler
    log = open_run_log(run, models)
    stop, bad_steps, t0 = StopRequest(), 0, time.perf_counter()  # SIGTERM / SIGINT: finish the step, save, exit
    if run.start_step == 0 and cfg.eval_before:
        evaluate_and_sample(run, models, log, 0, t0)  # the baseline: where the samples and the curves start
    for step in range(run.start_step, run.total_steps):
        lr = get_lr(step, cfg.lr, cfg.warmup_steps, run.total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_t0 = time.perf_counter()
        sums = train_step(run, models, run.batch(step))
        dist.all_reduce(sums)  # one collective per step for the metrics; one more for the maxima:
        peaks = torch.tensor([peak_memory_gb(device), float(stop.signum > 0)], device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the fullest rank's memory; whether any rank must stop
        # A global norm and loss: a NaN or an fp16 overflow on any rank skips the step on all of them.
        grad_norm, skipped = clip_and_step(models.policy, optimizer, scaler, cfg.mixed_precision.max_grad_norm,
                                           loss_sum=sums[0])
        row = train_row(run, models, step + 1, sums, peaks, grad_norm, skipped, lr, time.perf_counter() - step_t0)
        log.write({**row, "elapsed_s": time.perf_counter() - t0})
        show_progress(step + 1, run.total_steps, row)
        bad_steps = bad_steps + skip_counts(scaler, row["loss"]) if skipped else 0
        if bad_steps >= cfg.mixed_precision.max_skipped_steps:
            say(f"error: stopping at step {step + 1}: {bad_steps} consecutive steps since step "
                f"{step + 2 - bad_steps} had a non-finite loss or gradient norm")
            finish_checkpoint()
            log.close()
            return 1
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < run.total_steps:
            evaluate_and_sample(run, models, log, step + 1, t0)
        stopping = peaks[1].item() > 0
        if stopping or (cfg.checkpoints.save_every and (step + 1) % cfg.checkpoints.save_every == 0):
            path = save(run, models.policy, optimizer, step + 1)
        finish_checkpoint(wait=stopping)  # an --async-save written by now moves `latest`; stopping: wait for it
        if stopping:
            say(f"stopped by a signal after step {step + 1}: saved {path}; continue with --resume latest")
            log.close()  # and the W&B run finished: the process leaves without interpreter shutdown
            return 128 + (stop.signum or signal.SIGTERM)
    stop.restore()
    finish_checkpoint()
    evaluate_and_sample(run, models, log, run.total_steps, t0)
    export_final(run, models.policy, log)
    return 0


def build_optimizer(run: Run, policy) -> torch.optim.Optimizer:
    """AdamW over the float32 sharded master weights that train (LoRA: the adapters); then, when resuming, the
    checkpoint's state."""
    # fused: one kernel over all parameters (4x faster than the per-tensor loop on a 60M model on CPU).
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=run.cfg.lr,
                                  weight_decay=run.cfg.weight_decay, fused=True)
    if run.saved:
        same_rng = load_checkpoint(run.saved["path"], policy, optimizer)
        if run.precision.scaler and run.saved["scaler"]:
            run.precision.scaler.load_state_dict(run.saved["scaler"])
        say(f"resumed from {run.saved['path']} at step {run.start_step}" + (
            "" if same_rng else f" (saved on {run.saved['world_size']} ranks: random generators not restored)"))
    return optimizer


def open_run_log(run: Run, models: Models) -> RunLog:
    """metrics.jsonl (with the data's counts at step 0), samples.jsonl and W&B; the run's first lines."""
    cfg = run.cfg
    log = RunLog(cfg.out_dir, run.start_step, cfg.sampling.num_samples > 0 and len(run.eval) > 0,
                 cfg.wandb_project, asdict(cfg))
    mesh = next(models.policy.parameters()).device_mesh.shape  # as sharded: (ranks,), or HSDP's (replicas, shards)
    hsdp = f" as {mesh[0]} replicas x {mesh[1]} shards (HSDP)" if len(mesh) == 2 else ""
    params = [(p.numel(), p.requires_grad) for p in models.policy.parameters()]
    lora = (f" (LoRA rank {cfg.lora.lora_rank}: {sum(n for n, trained in params if trained) / 1e6:.2f}M trained)"
            if cfg.lora.lora_rank else "")
    say(f"{cfg.model}: {sum(n for n, _ in params) / 1e6:.1f}M params{lora}, {run.world} rank(s)"
        f"{hsdp} on {run.device} ({dist.get_backend()}), {run.precision.name}, {len(run.train)} train / {len(run.eval)} "
        f"eval pairs, {run.total_steps} steps x {cfg.batch_size} pairs "
        f"({cfg.batch_size // (cfg.micro_batch_size * run.world)} accumulation steps); peak host memory after "
        f"loading, GB by rank: {' '.join(f'{x:.2f}' for x in models.load_rss)}")
    for split in ("train", "eval"):
        d = run.data[split]
        if run.start_step == 0:
            log.write({"step": 0, "split": f"data/{split}", **{k: v for k, v in d.items() if not isinstance(v, dict)}})
        if d["pairs"] or d["dropped"]:
            say(f"{split} data: {d['pairs']} pairs; dropped {d['dropped']} (empty response {d['dropped_empty']}, "
                f"identical {d['dropped_identical']}, of which after truncation {d['identical_after_truncation']}); "
                f"truncated {d['truncated']} (prompts {d['truncated_prompts']}, responses {d['truncated_responses']})")
    if not len(run.eval):
        say("no --eval-data or --eval-fraction: evaluation skipped")
    return log


def train_row(run: Run, models: Models, step: int, sums, peaks, grad_norm, skipped: bool, lr: float,
              seconds: float) -> dict:
    """The step's metrics.jsonl row (without elapsed_s); says so when the step was skipped."""
    row = {"step": step, "split": "train", **step_metrics(sums, peaks, seconds, run.cfg.batch_size, run.metric_keys),
           "grad_norm": grad_norm.item(), "lr": lr, "skipped": skipped}
    if run.precision.scaler:
        row["loss_scale"] = run.precision.scaler.get_scale()
    row.update(mfu(row["flops"], seconds, run.world, run.device, run.precision.name))
    if skipped:
        say(f"step {step}: non-finite loss or gradient norm, step skipped on every rank")
    return row


def save(run: Run, policy, optimizer, step: int) -> str:
    """A sharded checkpoint of `step`, with what a bit-exact resume needs beside the weights."""
    cfg = run.cfg
    extra = {"step": step, **_identity(cfg, run.data),
             "data_position": {"epoch": step // run.steps_per_epoch,
                               "pairs_consumed": step % run.steps_per_epoch * cfg.batch_size},
             "schedule": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "total_steps": run.total_steps},
             "scaler": run.precision.scaler.state_dict() if run.precision.scaler else None}
    return save_checkpoint(os.path.join(cfg.out_dir, "checkpoints"), step, policy, optimizer, extra,
                           keep_last=cfg.checkpoints.keep_last, background=cfg.checkpoints.async_save)


# ---------------------------------------------------------------------------------------------- export
def export_final(run: Run, policy, log: RunLog) -> None:
    """{out_dir}/final: a Hugging Face folder of the trained policy in --export-dtype (LoRA: a peft adapter
    folder, or with --export-merged the merged weights), with the tokenizer and the resolved config; rank 0
    writes it, then closes the log (and plots metrics.png)."""
    rss, final, cfg = host_memory_by_rank_gb(run.device), os.path.join(run.cfg.out_dir, "final"), run.cfg
    say("peak host memory during training, GB by rank: " + " ".join(f"{x:.2f}" for x in rss))
    dtype, extra = getattr(torch, cfg.export_dtype), {"train_config.json": asdict(cfg)}
    if cfg.lora.lora_rank and not cfg.lora.export_merged:
        adapters = {k: v.to(dtype) for k, v in gather_adapters(policy).items()}  # only the adapters are gathered

        def write():  # peft's adapter_config.json and adapter_model.safetensors
            if cfg.model != "tiny":  # where its base comes from (the tiny base is a function of --seed)
                policy.peft_config["default"].base_model_name_or_path = cfg.model
            policy.save_pretrained(final, state_dict=adapters)
            save_files(final, run.tokenizer, extra)
        on_rank0(write, share=False)
    else:
        merge = (lambda state: merge_adapters(policy, state)) if cfg.lora.lora_rank else None
        save_pretrained(policy, final, dtype, run.tokenizer, extra, merge)
    say(f"saved {final}")
    on_rank0(log.close)  # only rank 0 has files (and W&B) to close; the others wait for it


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
        rank, world, device = init_distributed(cfg.fsdp.device)
    except ValueError as e:
        say(f"error: {e}")
        sys.exit(2)
    if device.type == "cuda":  # peak_mem_gb is this run's, also after an earlier run in this process
        torch.cuda.reset_peak_memory_stats(device)
    try:
        code = train(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def exit_without_shutdown(code: int | str | None) -> None:
    """Leave the process now, with sys.exit's `code`, skipping interpreter shutdown: a gloo worker thread can
    still be releasing a finished collective's tensors, which takes the GIL, and during shutdown that aborts
    the process (SIGABRT, "terminate called without an active exception"; 2-rank CPU runs, about 1 in 10
    under load) after a run that wrote everything. Every file is closed by then; metrics rows are
    line-buffered."""
    if isinstance(code, str):  # sys.exit("message") prints it
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        exit_without_shutdown(e.code)
    exit_without_shutdown(0)
