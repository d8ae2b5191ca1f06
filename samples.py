"""Evaluation samples: completions from a causal LM that may be sharded with FSDP2 over N ranks,
without hanging; when to evaluate (SampleConfig).

Copyable on its own: imports only the standard library and torch.

    completions = generate(model, [prompt_ids, ...], 48, eos_id=tok.eos_token_id, pad_id=0)
    # [{"prompt", "completion"}, ...]
    rows = sample_completions(model, tok, [prompt_ids, ...], SampleConfig(), pad_id=0)
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.num_samples < 0:
            raise ValueError(f"--num-samples must be >= 0, got {self.num_samples}")
        if self.sample_max_tokens < 1:
            raise ValueError(f"--sample-max-tokens must be >= 1, got {self.sample_max_tokens}")
        if self.sample_temperature < 0:
            raise ValueError(f"--sample-temperature must be >= 0, got {self.sample_temperature}")


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
) -> list[list[int]]:
    """Each prompt's completion ids without EOS: greedy at temperature 0, else sampled from a
    generator seeded by `seed`. A collective under torch.distributed, as every FSDP2 forward is one:
    call it on every rank. Unlike Hugging Face's `generate`, which stops when this rank's sequences
    end and hangs the others, ranks stop together. An FSDP2 model's blocks stay gathered for the
    whole generation where they fit, rather than gathered again for each token, then resharded.
    device: where forward runs (default: the parameters'; give it when they are offloaded to the
    host)."""
    device = device or next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # Left-padded, (B, P): every prompt ends where generation starts.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generator = torch.Generator(device).manual_seed(seed)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    # The new tokens, step by step, and the KV cache.
    out = []
    cache = None
    was_training = model.training
    model.eval()
    kept = _keep_gathered(model, device)
    for _ in range(max_new_tokens):
        result = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        cache = result.past_key_values
        logits = result.logits[:, -1].float()  # (B, V)
        if temperature > 0:
            probs = (logits / temperature).softmax(-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            token = logits.argmax(-1)
        token = token.masked_fill(done, pad_id)
        out.append(token)
        done |= token == eos_id
        all_done = done.all().float()
        # Stop only when every rank is done.
        if dist.is_initialized():
            dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        if all_done.item():
            break
        # (B, 1): the cache holds the rest.
        input_ids = token[:, None]
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    model.train(was_training)
    # Training's settings back, and only shards in memory again.
    for group, setting in kept:
        group.post_forward_mesh_info = setting
        group.reshard()
    # Each row of (B, new tokens) cut at its EOS.
    return [
        row[: row.index(eos_id)] if eos_id in row else row
        for row in torch.stack(out, dim=1).tolist()
    ]


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
