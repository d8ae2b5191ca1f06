"""What the K-response rows' masked attention costs, and what cheaper attention would save: the
bench model's blocks (no output layer), forward and backward, on B rows of a prompt and K responses
all L tokens long, with SDPA under loss.py's dense boolean mask (what the trainer runs) against one
other attention, in one process, rounds interleaved. The others:
  per-response: the prompt causal on its own keys, each response on the prompt's keys and its own
    (9 L^2 of the 25 L^2 square at K = 4); exact, so its max relative difference is printed too
  blocks: the queries in 4 blocks, each against the keys up to its end (exact)
  causal: no mask at all (not exact on these rows: what the kernel costs without a mask)
usage, from the repo root: python bench/segment_attention.py MODEL per-response|blocks|causal
[bf16|fp32] [ROUNDS]; prints one line per round and attention: seconds per step."""

import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

sys.path.insert(0, ".")
import loss  # noqa: E402  (run from the repo root)

ROWS, LENGTH, K = 2, 170, 4
BLOCKS = 4


def per_response(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA's result on these rows, the prompt and each response apart: (B, T, H, D)."""
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    b, h, _, d = query.shape
    p = LENGTH
    prompt = F.scaled_dot_product_attention(
        query[:, :, :p], key[:, :, :p], value[:, :, :p], is_causal=True, scale=scaling
    )
    # Each response's keys: the prompt's, then its own.
    keys = torch.cat([key[:, :, None, :p].expand(b, h, K, p, d), _responses(key)], 3)
    values = torch.cat([value[:, :, None, :p].expand(b, h, K, p, d), _responses(value)], 3)
    # keys, values: (B, H, K, P + L, D)
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=query.device).tril()
    seen = torch.cat([torch.ones(LENGTH, p, dtype=torch.bool, device=query.device), causal], 1)
    # The K responses folded into the heads: 4-D inputs, which the CPU's flash kernel takes (5-D
    # ones fall back to the math kernel).
    responses = F.scaled_dot_product_attention(
        _responses(query).flatten(1, 2),
        keys.flatten(1, 2),
        values.flatten(1, 2),
        attn_mask=seen,
        scale=scaling,
    )  # (B, H K, L, D)
    out = torch.cat([prompt, responses.reshape(b, h, K * LENGTH, d)], 2)
    return out.transpose(1, 2).contiguous(), None


def _responses(x):
    """(B, H, P + K L, D) -> (B, H, K, L, D): the responses' part, a response per index."""
    b, h, _, d = x.shape
    return x[:, :, LENGTH:].reshape(b, h, K, LENGTH, d)


def blocks(module, query, key, value, attention_mask, **kwargs):
    """SDPA over BLOCKS blocks of queries, each against the keys up to its end (the mask is causal,
    so the keys after are masked for all of its queries)."""
    length = query.shape[2]
    size = -(-length // BLOCKS)
    outs = []
    for start in range(0, length, size):
        end = min(start + size, length)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, :end],
            value[:, :, :end],
            attention_mask[:, :, start:end, :end],
            **kwargs,
        )
        outs.append(out)
    return torch.cat(outs, 1), None


def main():
    model_dir, other = sys.argv[1], sys.argv[2]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        sys.argv[3] if len(sys.argv) > 3 else "bf16"
    ]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    for name, function in (("per-response", per_response), ("blocks", blocks)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    segments = [torch.zeros(LENGTH, dtype=torch.long)]
    positions = [torch.arange(LENGTH)]
    for k in range(K):
        segments.append(torch.full((LENGTH,), k + 1))
        positions.append(torch.arange(LENGTH, 2 * LENGTH))
    rows = SimpleNamespace(
        segment_ids=torch.cat(segments).repeat(ROWS, 1),
        position_ids=torch.cat(positions).repeat(ROWS, 1),
    )  # (B, T)
    mask = loss._mask(model.config, rows, None)
    ids = torch.randint(0, model.config.vocab_size, rows.position_ids.shape)

    def step(attention):
        model.config._attn_implementation = "sdpa" if attention == "causal" else attention
        seen = None if attention == "causal" else mask
        hidden = model.model(input_ids=ids, attention_mask=seen, position_ids=rows.position_ids)
        hidden = hidden.last_hidden_state
        hidden.float().pow(2).mean().backward()
        model.zero_grad()
        return hidden.detach().float()

    dense = step("sdpa")
    if other != "causal":
        difference = (step(other) - dense).abs().max() / dense.abs().max()
        print(f"{other}: max difference from the dense mask's output, relative: {difference:.1e}")
    for r in range(rounds):
        for attention in ("sdpa", other):
            start = time.perf_counter()
            step(attention)
            print(f"round {r + 1} {attention}: {time.perf_counter() - start:.3f} s/step")


if __name__ == "__main__":
    main()
