"""Completions from a causal LM that may be sharded with FSDP2 over N ranks, without hanging: the
trainer's evaluation samples (SampleConfig), and on-policy rows (GenerateConfig, the command line):
K sampled responses per prompt, each scored, written as the K-response rows train_dpo.py reads.

Copyable on its own: imports the standard library, torch and transformers (tyro for the command
line).

    completions = generate(model, [prompt_ids, ...], 48, eos_id=tok.eos_token_id, pad_id=0)
    # [{"prompt", "completion"}, ...]
    rows = sample_completions(model, tok, [prompt_ids, ...], SampleConfig(), pad_id=0)
    # 4 samples per prompt of a file, scored by the demo's ground truth, on 2 ranks:
    torchrun --nproc_per_node=2 generate.py --model runs/cache/demo-sft/final \
        --data runs/cache/demo-train.jsonl --num-generations 4 --reward demo --out runs/rows.jsonl

This runs as written:

    import torch
    import transformers

    from generate import generate

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    # 2 sampled completions of each of 2 prompts, at most 6 tokens, ending at EOS (id 2) if any.
    prompts = [[5, 6, 7], [8, 9]]
    print(generate(model, prompts, 6, eos_id=2, pad_id=0, temperature=1.0, num_generations=2))
"""

import contextlib
import functools
import importlib
import io
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard


@dataclass
class SampleConfig:
    eval_every: int = 0
    """Evaluate on the held-out set every N steps; 0 means only at the end (and before, with
    --eval-before)."""
    eval_before: bool = True
    """Also evaluate and sample before the first step: the baseline of the curves and of the demo's
    scorer share."""
    num_samples: int = 8
    """At each evaluation, complete the first N held-out prompts into {out_dir}/samples.jsonl; 0
    disables."""
    sample_max_tokens: int = 64
    """Most new tokens per sampled completion."""
    sample_temperature: float = 0.0
    """0: greedy completions; above 0: sampled at this temperature with a generator seeded by
    --seed."""

    def __post_init__(self):
        _check_lower_bounds(
            self,
            {"eval_every": 0, "num_samples": 0, "sample_max_tokens": 1, "sample_temperature": 0},
        )


def _check_lower_bounds(config, lowest: dict[str, float]) -> None:
    """ValueError naming the first of `config`'s fields below its lowest value in `lowest` (or not
    a number: NaN)."""
    for name, low in lowest.items():
        value = getattr(config, name)
        if not value >= low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def sample_completions(
    model,
    tokenizer,
    prompts: list[list[int]],
    config: SampleConfig,
    pad_id: int,
    seed: int = 0,
    device: torch.device | None = None,
) -> list[dict[str, str]]:
    """generate's completions under `config` as {"prompt", "completion"} texts; a collective like
    generate."""
    if not prompts:
        return []
    completions = generate(
        model,
        prompts,
        config.sample_max_tokens,
        tokenizer.eos_token_id,
        pad_id,
        config.sample_temperature,
        seed,
        device,
    )
    return [
        {
            "prompt": tokenizer.decode(p, skip_special_tokens=True),
            "completion": tokenizer.decode(c, skip_special_tokens=True),
        }
        for p, c in zip(prompts, completions)
    ]


@dataclass
class GenerateConfig:
    model: str = "runs/cache/demo-sft/final"
    """The policy to sample from: a Hugging Face hub id or folder, such as a run's {out_dir}/final,
    or tiny (train_dpo.py's random-init model at --seed). Default: the demo's SFT stage, which
    train_dpo.py writes on its first default run."""
    data: str = "runs/cache/demo-train.jsonl"
    """The prompts: a .jsonl or .json file, or hub:NAME[:split] (needs datasets), whose rows each
    have a "prompt", text or a list of messages; any other field is ignored (default: the demo's
    training prompts, which train_dpo.py writes on its first default run)."""
    out: str = "runs/onpolicy/rows.jsonl"
    """Where the rows go, as JSON Lines {"prompt", "responses", "scores", "cut"} ("cut": whether
    --max-new-tokens stopped each completion before its EOS), in the prompts' order; the settings,
    the time and the count of cut completions go next to it, in {out}.json."""
    num_generations: int = 4
    """K: completions sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; 0: greedy (the K completions are then all alike)."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probabilities reach this share; 1: all."""
    max_new_tokens: int = 64
    """Most new tokens per completion."""
    seed: int = 0
    """Each completion is sampled from a generator of its own, seeded by (seed, the prompt's place
    in the data, its number among the K): the same seed writes the same file on any number of
    ranks."""
    reward: str = "demo"
    """The scorer: "demo" (the demo's ground truth, +1, 0 or -1), "module:function" (a Python
    callable (prompt, completion) -> float, importable from the working directory), or a Hugging
    Face sequence-classification reward model's hub id or folder (one score per text), which scores
    each row as train_dpo.py reads one (--loss bradley_terry trains such a model): a conversation
    (message-list prompt) as its chat template writes it, a text prompt + completion as text with
    one EOS at its end."""
    batch_size: int = 8
    """Prompts per forward (each with its K completions)."""
    skip_prompts: int = 0
    """Start at this prompt of the data: a round's slice begins here."""
    max_prompts: int = 0
    """Take at most this many prompts from there; 0: all the rest."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """The weights' dtype: auto is bf16 on a GPU and fp32 on a CPU."""

    def __post_init__(self):
        _check_lower_bounds(
            self,
            {
                "num_generations": 1,
                "temperature": 0,
                "max_new_tokens": 1,
                "batch_size": 1,
                "skip_prompts": 0,
                "max_prompts": 0,
            },
        )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


# Compiled blocks run eager here: generation's variants (KV cache, one-token queries, one per layer
# index) would fill the training graph's recompile limit, past which training runs eager too.
@torch.no_grad()
@torch.compiler.set_stance("force_eager")
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 0.0,
    seed: int = 0,
    device: torch.device | None = None,
    top_p: float = 1.0,
    num_generations: int = 1,
    first: int = 0,
) -> list[list[int]]:
    """Each prompt's `num_generations` completions (prompt by prompt), ids ending with EOS where
    the completion ended (none where `max_new_tokens` cut it short): greedy at temperature 0, else
    sampled, each from a generator of its own seeded by (`seed`, `first` + the prompt's index, the
    completion's number), so that a prompt gets the same completions in any batch of the same
    prompts on any rank. Each prompt is prefilled once and its KV cache repeated
    for its completions. A collective under torch.distributed, as every FSDP2 forward is one: call
    it on every rank. Unlike Hugging Face's `generate`, which stops when this rank's sequences end
    and hangs the others, ranks stop together. An FSDP2 model's blocks stay gathered for the whole
    generation where they fit, rather than gathered again for each token, then resharded. device:
    where forward runs (default: the parameters'; give it when they are offloaded to the host)."""
    device = device or next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # Left-padded, (B, P): every prompt ends where generation starts.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    generators = [
        torch.Generator(device).manual_seed(
            random.Random(f"{seed}/{first + i}/{k}").getrandbits(63)
        )
        for i in range(len(prompts))
        for k in range(num_generations)
    ]
    done = torch.zeros(len(generators), dtype=torch.bool, device=device)
    # The new tokens, step by step, and the KV cache.
    out = []
    cache = None
    was_training = model.training
    model.eval()
    kept = _keep_gathered(model, device)
    for step in range(max_new_tokens):
        # The fed tokens' positions: how many tokens of their row come before them, padding aside.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        result = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        cache = result.past_key_values
        logits = result.logits[:, -1].float()  # (B, V)
        if step == 0 and num_generations > 1:
            # The prompts' forward once; each of their caches repeated for its K completions, as
            # the rows after it, (B * K, ...).
            cache.batch_repeat_interleave(num_generations)
            logits = logits.repeat_interleave(num_generations, dim=0)
            mask = mask.repeat_interleave(num_generations, dim=0)
        token = _next_tokens(logits, temperature, top_p, generators).masked_fill(done, pad_id)
        out.append(token)
        done |= token == eos_id
        all_done = done.all().float()
        # Stop only when every rank is done.
        if dist.is_initialized():
            dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        if all_done.item():
            break
        # (B * K, 1): the cache holds the rest.
        input_ids = token[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    model.train(was_training)
    # Training's settings back, and only shards in memory again.
    for group, setting in kept:
        group.post_forward_mesh_info = setting
        group.reshard()
    # Each row of (B * K, new tokens) up to its EOS; one without EOS was cut by max_new_tokens.
    return [
        row[: row.index(eos_id) + 1] if eos_id in row else row
        for row in torch.stack(out, dim=1).tolist()
    ]


def _next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list
) -> torch.Tensor:
    """(B,) tokens after (B, V) float32 logits: the argmax at temperature 0; else row i's draw from
    softmax(logits / temperature), cut to the top-p nucleus, by generators[i]. The draw is
    Gumbel-max (the argmax of the logits plus Gumbel noise is a sample of their softmax), so each
    row's noise comes from its own generator."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_p < 1:
        ranked, order = logits.sort(-1, descending=True)
        probs = ranked.softmax(-1)
        # The tokens past the smallest set reaching top_p; the first is always kept.
        outside = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, ranked.masked_fill(outside, -math.inf))
    noise = torch.stack(
        [torch.rand(logits.shape[-1], generator=g, device=logits.device) for g in generators]
    )
    return (logits - (-noise.log()).log()).argmax(-1)


def generate_rows(
    model, tokenizer, prompts: list, config: GenerateConfig, score, device: torch.device
) -> tuple[list[dict], int]:
    """(rows, tokens generated) on rank 0, ([], 0) elsewhere: for each prompt (text or messages) its
    K completions, their scores by score(prompts, completions) -> floats, and whether
    --max-new-tokens cut each short, as {"prompt", "responses", "scores", "cut"} in the prompts'
    order. Batches of --batch-size prompts are dealt to the ranks in turn, formed alike on any
    number of ranks."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    starts = range(0, len(prompts), config.batch_size)
    k = config.num_generations
    rows = []
    tokens = 0
    t0 = time.perf_counter()
    # Every rank runs as many batches, since each forward is a collective: a rank past the end
    # repeats the first batch and drops its rows.
    for b in range(rank, -(-len(starts) // world) * world, world):
        first = starts[b] if b < len(starts) else 0
        batch = prompts[first : first + config.batch_size]
        completions = generate(
            model,
            [_prompt_ids(p, tokenizer, f"prompt {first + i + 1}") for i, p in enumerate(batch)],
            config.max_new_tokens,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            config.temperature,
            config.seed,
            device,
            config.top_p,
            k,
            first,
        )
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        # Cut short: the trainer appends no EOS to these, and --missing-eos-penalty lowers them.
        cut = [c[-1] != tokenizer.eos_token_id for c in completions]
        scores = [float(s) for s in score([p for p in batch for _ in range(k)], texts)]
        bad = [s for s in scores if not math.isfinite(s)]
        if bad:
            raise ValueError(f"--reward {config.reward}: gave {bad[0]}, not a finite score")
        if b < len(starts):
            tokens += sum(map(len, completions))
            rows += [
                (
                    first + i,
                    {
                        "prompt": prompt,
                        # Text after a text prompt, an assistant turn after messages.
                        "responses": [
                            [{"role": "assistant", "content": t}] if isinstance(prompt, list) else t
                            for t in texts[i * k : (i + 1) * k]
                        ],
                        "scores": scores[i * k : (i + 1) * k],
                        "cut": cut[i * k : (i + 1) * k],
                    },
                )
                for i, prompt in enumerate(batch)
            ]
        if rank == 0:
            done = min((b + world) * config.batch_size, len(prompts))
            rate = tokens * world / (time.perf_counter() - t0)
            print(f"generate: {done}/{len(prompts)} prompts, {rate:.0f} tokens/s", flush=True)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((rows, tokens), gathered)
    if rank:
        return [], 0
    # (index, row) pairs: in the prompts' order by their index, which is unique.
    ordered = sorted(pair for part, _ in gathered for pair in part)
    return [row for _, row in ordered], sum(n for _, n in gathered)


def _prompt_ids(prompt, tokenizer, where: str) -> list[int]:
    """A prompt's ids as train_dpo.py's data reads them, so that the completions are on-policy for
    the rows it trains on: a message list through the chat template with its generation prompt;
    text as it is, after the tokenizer's leading special tokens (BOS) unless it has them."""
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{where}: message lists need a chat template, and the tokenizer has none"
            )
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = tokenizer(prompt)["input_ids"]
    prefix = next(
        (full[:i] for i in range(len(full) - len(ids) + 1) if full[i : i + len(ids)] == ids), []
    )
    return ids if ids[: len(prefix)] == prefix else prefix + ids


def read_prompts(spec: str) -> list:
    """Each row's "prompt" of a .jsonl or .json file, or of hub:NAME[:split]; a ValueError naming
    the file and line (or row) of a bad one."""
    if spec.startswith("hub:"):
        try:
            import datasets
        except ImportError:
            raise ValueError(
                f"--data {spec}: needs the datasets package: pip install datasets"
            ) from None
        name, _, split = spec[len("hub:") :].partition(":")
        rows = [
            (f"{spec} row {i + 1}", row)
            for i, row in enumerate(datasets.load_dataset(name, split=split or "train"))
        ]
    elif not os.path.isfile(spec):
        raise ValueError(f"--data {spec}: no such file")
    elif open(spec, encoding="utf-8-sig").read(1) == "[":
        with open(spec, encoding="utf-8-sig") as f:
            rows = [(f"{spec} row {i + 1}", row) for i, row in enumerate(json.load(f))]
    else:
        with open(spec, encoding="utf-8-sig") as f:
            rows = [(f"{spec}:{i}", line) for i, line in enumerate(f, start=1) if line.strip()]
    prompts = []
    for where, row in rows:
        if isinstance(row, str):
            try:
                row = json.loads(row)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not prompt or not isinstance(prompt, (str, list)):
            raise ValueError(f"{where}: field 'prompt' must be non-empty text or messages")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--data {spec}: no prompts")
    return prompts


def load_scorer(spec: str, device: torch.device, dtype: torch.dtype):
    """--reward's scorer, score(prompts, completions) -> one float each: "demo" and
    "module:function" call a Python function (prompt, completion) -> float on each; anything else
    is a reward model's hub id or folder, sharded over the ranks like the policy."""
    if spec == "demo":
        spec = "demo:score_response"
    if ":" not in spec:
        return _reward_model(spec, device, dtype)
    module, _, name = spec.partition(":")
    # The working directory's modules, as `python -m` would find them.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec}: cannot load it ({e})") from None
    if not callable(function):
        raise ValueError(f"--reward {spec}: is not a function")

    def score(prompts: list, completions: list[str]) -> list:
        return [function(p, c) for p, c in zip(prompts, completions)]

    return score


def _reward_model(name: str, device: torch.device, dtype: torch.dtype):
    """A sequence-classification reward model's scorer of each (prompt, completion), written as
    train_dpo.py writes a row (a reward model trained there scores as it trained): a message-list
    prompt's conversation by the chat template, a text prompt + completion as text with one EOS
    at its end."""
    tokenizer, model = _from_pretrained(
        name,
        transformers.AutoModelForSequenceClassification,
        dtype,
        f"--reward {name}: not demo or module:function, and no reward model loads from it",
    )
    if model.config.num_labels != 1:
        raise ValueError(
            f"--reward {name}: its head gives {model.config.num_labels} scores per text, not one"
        )
    # The model reads each text's score at its last token that is not padding.
    model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    _shard(model, device).eval()

    @torch.no_grad()
    def score(prompts: list, completions: list[str]) -> list:
        # Each as train_dpo.py reads a row: a conversation by the chat template (its special tokens
        # included), a text prompt + completion as text, ending with one EOS.
        ids = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                chat = prompt + [{"role": "assistant", "content": completion}]
                text = tokenizer.apply_chat_template(chat, tokenize=False)
                ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                text_ids = tokenizer(prompt + completion)["input_ids"]
                eos = [tokenizer.eos_token_id]
                ids.append(text_ids if text_ids[-1:] == eos else text_ids + eos)
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        return model(**batch.to(device)).logits[:, 0].float().tolist()

    return score


def _shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` sharded over every rank with FSDP2 onto `device`: each block (of its largest
    ModuleList), then the root."""
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    for block in max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=[]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _from_pretrained(name: str, model_class, dtype: torch.dtype, failure: str) -> tuple:
    """(tokenizer, model of `model_class`) of a hub id or folder, the tokenizer padding with EOS
    where it has no pad token; where either does not load, a ValueError of one line: `failure`,
    then the cause's first line in brackets."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        model = model_class.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"{failure} ({str(e).strip().splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def write_rows(config: GenerateConfig, rows: list[dict], tokens: int, seconds: float) -> dict:
    """The rows as JSON Lines at --out and the settings at {out}.json, each whole or not at all;
    returns the settings."""
    os.makedirs(os.path.dirname(os.path.abspath(config.out)), exist_ok=True)
    sidecar = {
        **asdict(config),
        "ranks": dist.get_world_size(),
        "prompts": len(rows),
        "generated_tokens": tokens,
        "seconds": round(seconds, 3),
        "mean_score": sum(map(sum, (r["scores"] for r in rows)))
        / (len(rows) * config.num_generations),
        "cut_completions": sum(map(sum, (r["cut"] for r in rows))),
    }
    for path, text in (
        (config.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)),
        (config.out + ".json", json.dumps(sidecar, indent=2) + "\n"),
    ):
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            # A full disk: no partial file stays.
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
            raise ValueError(f"{path}: not written ({e})") from None
        os.replace(path + ".tmp", path)
    return sidecar


def run(config: GenerateConfig) -> None:
    """The command line's work: start the process group (a world of one without torchrun), load,
    shard, sample, score, and write on rank 0."""
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dtype = (
            torch.bfloat16
            if config.precision == "bf16" or (config.precision == "auto" and cuda)
            else torch.float32
        )
        # The defaults name the demo's files, which train_dpo.py's first default run writes.
        missing = [
            f"--{name} {getattr(config, name)}"
            for name in ("model", "data")
            if getattr(config, name) == getattr(GenerateConfig, name)
            and not os.path.exists(getattr(config, name))
        ]
        if missing:
            raise ValueError(
                f"{' and '.join(missing)}: the demo's, not written yet: run python train_dpo.py "
                "once first (its first run writes them), or give --model and --data"
            )
        prompts = read_prompts(config.data)[config.skip_prompts :][: config.max_prompts or None]
        if not prompts:
            raise ValueError(f"--skip-prompts {config.skip_prompts}: past the last prompt")
        tokenizer, policy = _load_policy(config.model, dtype, config.seed)
        _shard(policy, device)
        score = load_scorer(config.reward, device, dtype)
        t0 = time.perf_counter()
        rows, tokens = generate_rows(policy, tokenizer, prompts, config, score, device)
        if dist.get_rank() == 0:
            sidecar = write_rows(config, rows, tokens, time.perf_counter() - t0)
            print(
                f"generate: wrote {len(rows)} rows to {config.out}; {sidecar['cut_completions']} "
                f"of {len(rows) * config.num_generations} completions were cut at --max-new-tokens "
                f'{config.max_new_tokens} (marked in "cut": the trainer appends no EOS to them)',
                flush=True,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _load_policy(name: str, dtype: torch.dtype, seed: int) -> tuple:
    """(tokenizer, model) of a hub id or folder; "tiny": train_dpo.py's random-init tiny Llama at
    `seed` with its byte tokenizer, as its --model tiny builds them (it writes noise: for trying a
    pipeline without a download)."""
    if name != "tiny":
        return _from_pretrained(
            name, transformers.AutoModelForCausalLM, dtype, f"--model {name}: cannot load"
        )
    tokenizer = transformers.ByT5Tokenizer(
        chat_template=(
            "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
            "{% if m.role == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
        )
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return tokenizer, transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and run; bad input exits 2 with one line."""
    transformers.utils.logging.disable_progress_bar()
    try:
        run(parse_flags(GenerateConfig, argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def parse_flags(config_class, argv: list[str] | None, *markers):
    """`config_class` from the command line by tyro (imported here, so that the rest needs only
    torch and transformers), `markers` from tyro.conf on all of it; train_dpo.py's flags too. Its
    --help flows each flag's text (_flowing_help); a parse error is one ValueError line, tyro's
    words naming the flag where they do (_one_line), for main() to print (exit 2), not tyro's box.
    Both through tyro's public API: a constructor registry's rule, and what tyro writes to stderr
    before it exits."""
    import tyro

    registry = tyro.constructors.ConstructorRegistry()
    registry.struct_rule(_flowing_help)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            config = tyro.cli(config_class, args=argv, config=markers, registry=registry)
    except SystemExit as e:
        if e.code != 2:
            raise
        raise ValueError(_one_line(said.getvalue())) from None
    # Whatever else was said (a warning, say) is not lost.
    sys.stderr.write(said.getvalue())
    return config


def _flowing_help(info):
    """tyro's own rule for a dataclass, with each field's text as flowing paragraphs: tyro keeps a
    docstring's line break before a line that opens with "--" or a digit, ragged in a terminal.
    A default of None is decided later, and the text says how: no "(default: None)" after it.
    The type comes back marked with this rule, which then declines it: tyro's rules answer."""
    import tyro

    if not is_dataclass(info.type) or _flowing_help in info.markers:
        return None
    spec = tyro.constructors.ConstructorRegistry.get_struct_spec(
        replace(info, markers=(*info.markers, _flowing_help))
    )
    flowing = []
    for field_ in spec.fields:
        # No "(default: None)", as the text says what decides it; None keeps tyro's hint.
        hint = tyro.conf.arg(help_behavior_hint="" if field_.default is None else None)
        flowing.append(
            replace(
                field_,
                # Read when shown: a class that runpy ran has no source file for tyro to read
                # otherwise.
                helptext=functools.partial(_flowing, field_.helptext),
                type=Annotated[field_.type, hint],
            )
        )
    return replace(spec, fields=tuple(flowing))


def _flowing(helptext) -> str | None:
    """tyro's text for a field (or what gives it), each of its paragraphs on one line."""
    text = helptext() if callable(helptext) else helptext
    return "\n\n".join(" ".join(lines.split()) for lines in (text or "").split("\n\n")) or None


def _one_line(said: str) -> str:
    """The first paragraph of what tyro said of a parse error (a title, paragraphs between rules,
    the --help hint; in a box on a terminal) on one line, in tyro's words, which name the flag
    where they can; a config's own check without tyro's "Error parsing Config: " before it."""
    # Colours (on a terminal) and the box's sides out, then the title.
    text = re.sub(r"\x1b\[[0-9;]*m|[│╭╮╰╯]", "", said).partition("\n")[2]
    # Rows that are blank or a rule (of ─ or -) end paragraphs: the first with words.
    paragraphs = re.split(r"^[ ─-]*$", text, flags=re.MULTILINE)
    first = next((" ".join(p.split()) for p in paragraphs if p.strip()), said)
    return re.sub(r"^Error parsing (?:(--\S+: )|\S+: )", r"\1", first)


def _keep_gathered(model, device: torch.device) -> list:
    """An FSDP2 model's parameter groups, each with its reshard-after-forward setting, turned off
    where the gathered parameters fit on `device`: one all-gather per block for a whole generation,
    not one per token. [] where nothing changed."""
    if not hasattr(model, "set_reshard_after_forward"):
        return []
    if device.type == "cuda":
        dtype = model._get_fsdp_state()._mp_policy.param_dtype or torch.float32
        gathered = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        # What this process can still allocate: free, or cached and unused.
        room = (
            torch.cuda.mem_get_info(device)[0]
            + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device)
        )
        # A quarter stays for the KV cache, activations and logits; past that, per token as before.
        # Every rank decides alike: one keeping its blocks gathered would skip the all-gathers that
        # the others wait in.
        fits = torch.tensor(float(gathered <= 0.75 * room), device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        if not fits.item():
            return []
    # The root settles its own setting (kept gathered, unless asked) at its first forward: settled
    # before it is saved, so that training gets what it would have had.
    model._get_fsdp_state()._lazy_init()
    kept = [
        (group, group.post_forward_mesh_info)
        for module in model.modules()
        if hasattr(module, "set_reshard_after_forward")
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]
    model.set_reshard_after_forward(False)
    return kept


if __name__ == "__main__":
    main()
