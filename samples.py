"""Completions from a causal LM that may be sharded with FSDP2 over N ranks, without hanging.

Copyable on its own: imports only the standard library and torch.

    completions = generate(model, [prompt_ids, ...], max_new_tokens=48, eos_id=tok.eos_token_id, pad_id=0)
    rows = sample_completions(model, tok, [prompt_ids, ...], SampleConfig(), pad_id=0)  # {"prompt", "completion"}

Under FSDP2 every forward is a collective (each layer's parameters are all-gathered), so every rank must run
the same number of forwards. Hugging Face's `generate` stops when this rank's sequences end, which differs
between ranks that sample differently, and then hangs the others. Here the ranks agree after each token
whether all of them are done (one tiny all-reduce), and stop together.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SampleConfig:
    num_samples: int = 8
    """At each evaluation, complete the first N held-out prompts into {out_dir}/samples.jsonl; 0 disables."""
    sample_max_tokens: int = 64
    """Most new tokens per sampled completion."""
    sample_temperature: float = 0.0
    """0: greedy completions; above 0: sampled at this temperature with a generator seeded by --seed."""

    def __post_init__(self):
        for name in ("num_samples", "sample_max_tokens", "sample_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


def sample_completions(model, tokenizer, prompts: list[list[int]], config: SampleConfig, pad_id: int,
                       seed: int = 0) -> list[dict[str, str]]:
    """{"prompt", "completion"} texts (decoded without special tokens) of generate under `config`; a collective
    like generate."""
    completions = generate(model, prompts, config.sample_max_tokens, tokenizer.eos_token_id, pad_id,
                           config.sample_temperature, seed)
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return [{"prompt": text(p), "completion": text(c)} for p, c in zip(prompts, completions)]


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int,
             temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """Each prompt's completion ids (up to and without EOS): greedy when temperature is 0, else sampled from
    softmax(logits / temperature) with a generator seeded by `seed` (the same draws on every call). A
    collective when torch.distributed is initialised: call it on every rank, with the same number of prompts."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # (B, P) left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generator = torch.Generator(device).manual_seed(seed)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out, cache, was_training = [], None, model.training
    model.eval()
    for _ in range(max_new_tokens):
        result = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True)
        cache, logits = result.past_key_values, result.logits[:, -1].float()  # (B, V)
        if temperature > 0:
            token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
        else:
            token = logits.argmax(-1)
        token = token.masked_fill(done, pad_id)
        out.append(token)
        done |= token == eos_id
        all_done = done.all().float()
        if dist.is_initialized():
            dist.all_reduce(all_done, op=dist.ReduceOp.MIN)  # stop only when every rank is done
        if all_done.item():
            break
        input_ids, positions = token[:, None], positions[:, -1:] + 1  # (B, 1): the cache holds the rest
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    model.train(was_training)
    completions = []
    for row in torch.stack(out, dim=1).tolist():  # (B, new tokens)
        completions.append(row[:row.index(eos_id)] if eos_id in row else row)
    return completions
