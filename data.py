"""Preference data: read {prompt, chosen, rejected} files, tokenize, batch.

Copyable on its own: imports only the standard library and torch (a tokenizer is passed in).

    pairs = load_pairs("prefs.jsonl")                    # or "demo", "demo:eval"
    tokens = tokenize_pairs(pairs, tokenizer, max_length=512, max_prompt_length=256)
    for step_indices in build_batches(len(tokens), batch_size=64, rank=r, world_size=w, seed=0, epoch=0,
                                      lengths=pair_lengths(tokens)):
        batch = collate_pairs([tokens[i] for i in step_indices[:8]], pad_id)   # (2B, T) tensors
"""

import json
import os
import random
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class DataConfig:
    data: str = "demo"
    """Training pairs: JSON Lines or a JSON array of {"prompt", "chosen", "rejected"} strings, or "demo"."""
    eval_data: str | None = None
    """Held-out pairs, same format. Default: "demo:eval" (the demo's held-out split) with --data demo, else none."""
    max_length: int = 512
    """Most tokens in prompt plus response; longer pairs are truncated."""
    max_prompt_length: int = 256
    """Most prompt tokens kept (from the end) when a pair is longer than --max-length."""
    group_by_length: bool = True
    """Batch pairs of similar length together (sorted within mega-batches, batch order shuffled): less padding."""

    def __post_init__(self):
        if not 0 < self.max_prompt_length < self.max_length:
            raise ValueError(f"need 0 < --max-prompt-length ({self.max_prompt_length}) < --max-length "
                             f"({self.max_length}), so every response keeps at least one token")


class DataError(ValueError):
    """Bad input data; the message names the file, line and field."""


# ---------------------------------------------------------------------------------------------- reading
def load_pairs(spec: str) -> list[dict[str, str]]:
    """Read preference pairs from "demo", "demo:eval", or a .jsonl / .json file. Raises DataError."""
    if spec in ("demo", "demo:train", "demo:eval"):
        return _demo_pairs("eval" if spec == "demo:eval" else "train")
    if not os.path.isfile(spec):
        raise DataError(f"{spec}: no such file (give a .jsonl/.json path, or 'demo')")
    with open(spec, encoding="utf-8") as f:
        text = f.read()
    start = len(text) - len(text.lstrip())
    if start == len(text):
        raise DataError(f"{spec}:1: empty file, expected {{\"prompt\", \"chosen\", \"rejected\"}} rows")
    rows = _read_json_array(spec, text, start) if text[start] == "[" else _read_json_lines(spec, text)
    if not rows:
        raise DataError(f"{spec}:1: no preference pairs in file")
    return [_check_row(spec, line, row) for line, row in rows]


def _read_json_lines(path: str, text: str) -> list[tuple[int, object]]:
    rows = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            try:
                rows.append((line, json.loads(raw)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line}: invalid JSON ({e.msg} at column {e.colno})") from None
    return rows


def _read_json_array(path: str, text: str, start: int) -> list[tuple[int, object]]:
    # Decode element by element so every row keeps the line it starts on, for error messages.
    decoder, rows, i = json.JSONDecoder(), [], start + 1

    def skip_ws(j):
        while j < len(text) and text[j].isspace():
            j += 1
        return j

    def fail(j, what):
        raise DataError(f"{path}:{text.count(chr(10), 0, j) + 1}: invalid JSON ({what})")

    i = skip_ws(i)
    if i < len(text) and text[i] == "]":
        return rows
    while True:
        try:
            row, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        rows.append((text.count("\n", 0, i) + 1, row))
        i = skip_ws(end)
        if i >= len(text):
            fail(i, "array is not closed with ']'")
        if text[i] == "]":
            break
        if text[i] != ",":
            fail(i, f"expected ',' or ']' after an element, found {text[i]!r}")
        i = skip_ws(i + 1)
    if skip_ws(i + 1) < len(text):
        fail(skip_ws(i + 1), "extra data after the closing ']'")
    return rows


def _check_row(path: str, line: int, row: object) -> dict[str, str]:
    if not isinstance(row, dict):
        raise DataError(f"{path}:{line}: expected an object with fields prompt, chosen, rejected; "
                        f"got {type(row).__name__}")
    for field in _FIELDS:
        if field not in row:
            raise DataError(f"{path}:{line}: missing field '{field}'")
        if not isinstance(row[field], str):
            raise DataError(f"{path}:{line}: field '{field}' must be a string, got {type(row[field]).__name__}")
    return {field: row[field] for field in _FIELDS}


# ---------------------------------------------------------------------------------------------- demo task
_ADJECTIVES = ["red", "blue", "green", "old", "new", "small", "big", "cheap", "shiny", "wooden", "steel",
               "plastic", "heavy", "light", "quiet", "loud"]
_TRAIN_NOUNS = ["kettle", "lamp", "chair", "phone", "watch", "bike", "drill", "tent", "radio", "camera",
                "blender", "toaster", "jacket", "backpack", "mug", "pillow", "desk", "fan", "heater", "scarf"]
_EVAL_NOUNS = ["guitar", "helmet", "sofa", "stove", "wallet", "printer"]  # never seen in training
_GOOD = ["great", "superb", "lovely", "excellent", "wonderful"]
_GOOD_WHY = ["works well", "feels solid", "looks nice", "is worth it"]
_BAD = ["bad", "awful", "poor", "terrible", "useless"]
_BAD_WHY = ["broke fast", "feels cheap", "looks ugly", "is a waste"]


def _demo_pairs(split: str) -> list[dict[str, str]]:
    """Deterministic synthetic reviews: chosen answers praise the product, rejected ones pan it.

    The held-out split reviews products whose nouns never occur in training, so a policy must learn the
    style (praise, "5/5"), not memorise items. The same set on every machine and seed.
    """
    rng = random.Random(f"demo-{split}")
    nouns, n = (_TRAIN_NOUNS, 2048) if split == "train" else (_EVAL_NOUNS, 256)
    pairs = []
    for _ in range(n):
        item = f"{rng.choice(_ADJECTIVES)} {rng.choice(nouns)}"
        good = f" The {item} is {rng.choice(_GOOD)} and {rng.choice(_GOOD_WHY)}. 5/5"
        bad = f" The {item} is {rng.choice(_BAD)} and {rng.choice(_BAD_WHY)}. 1/5"
        pairs.append({"prompt": f"Review the {item}:", "chosen": good, "rejected": bad})
    return pairs


# ---------------------------------------------------------------------------------------------- tokens
def tokenize_pairs(pairs: list[dict[str, str]], tokenizer, max_length: int,
                   max_prompt_length: int) -> list[dict[str, list[int]]]:
    """Token ids per pair: {"prompt", "chosen", "rejected"}.

    The prompt is the tokenizer's usual leading special tokens (BOS, if it adds one) plus the prompt text;
    each response is its text plus EOS. Responses are tokenized on their own, so a pair's two rows share
    exactly the same prompt ids. When prompt + longer response exceeds max_length, the prompt keeps its
    last max_prompt_length tokens (the special prefix is kept), then both responses are cut to fit; a
    cut response loses its EOS, since the text did not end there.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; responses must end with one")
    prefix = _leading_special_ids(tokenizer)
    out = []
    for pair in pairs:
        prompt = tokenizer(pair["prompt"], add_special_tokens=False)["input_ids"]
        chosen = tokenizer(pair["chosen"], add_special_tokens=False)["input_ids"] + [eos]
        rejected = tokenizer(pair["rejected"], add_special_tokens=False)["input_ids"] + [eos]
        if len(prefix) + len(prompt) + max(len(chosen), len(rejected)) > max_length:
            keep = max(max_prompt_length - len(prefix), 0)
            prompt = prompt[-keep:] if keep else []
            room = max_length - len(prefix) - len(prompt)
            chosen, rejected = chosen[:room], rejected[:room]
        out.append({"prompt": prefix + prompt, "chosen": chosen, "rejected": rejected})
    return out


def _leading_special_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before text by default (Llama's BOS; nothing for GPT-2, Qwen, ByT5)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i]
    return []


def collate_pairs(pairs: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack B pairs as 2B rows, all chosen then all rejected, with every response starting at one column.

    Prompts are left-padded to the longest prompt P, responses right-padded to the longest response, so
    the rows are (2B, T) with T = P + longest response, and only logits from column P - 1 on are ever
    scored: a model can skip the output layer for the prompt columns (Hugging Face's `logits_to_keep`).
    Returns input_ids, attention_mask, position_ids (counting real tokens only, so left padding does not
    shift positions) and labels, each (2B, T) int64, plus `response_start` = P (an int). labels are
    IGNORE_INDEX on prompt and padding positions, so only response tokens (and their EOS) are scored.
    """
    rows = [(pair["prompt"], pair[key]) for key in ("chosen", "rejected") for pair in pairs]
    start = max(len(prompt) for prompt, _ in rows)
    width = start + max(len(response) for _, response in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        first, end = start - len(prompt), start + len(response)
        input_ids[i, first:end] = torch.tensor(prompt + response)
        labels[i, start:end] = torch.tensor(response)
        attention_mask[i, first:end] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "labels": labels, "response_start": start}


# ---------------------------------------------------------------------------------------------- order
def pair_lengths(pairs: list[dict[str, list[int]]]) -> list[tuple[int, int]]:
    """(prompt, longer response) token counts per tokenized pair: what collate_pairs pads, separately."""
    return [(len(p["prompt"]), max(len(p["chosen"]), len(p["rejected"]))) for p in pairs]


def build_batches(n_pairs: int, batch_size: int, rank: int, world_size: int, seed: int, epoch: int,
                  lengths: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """This rank's pair indices for each optimizer step of one epoch.

    The epoch's order is a shuffle seeded by (seed, epoch), identical on every rank. With `lengths`
    (pair_lengths), the order is grouped by length: each mega-batch of _MEGA global batches is sorted by
    prompt length, cut into strips of _STRIP batches, and each strip sorted by response length; cut into
    global batches, whose order is shuffled again. A batch then holds pairs with similar prompts and similar
    responses (collate_pairs pads the two separately), while batches still come in random order. Each global
    batch of batch_size pairs is split into world_size contiguous, disjoint slices; rank r takes slice r. A
    last partial batch is dropped, so every step sees exactly batch_size pairs.
    """
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} is not divisible by {world_size} ranks")
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_pairs, generator=generator).tolist()
    if lengths is not None:
        mega, strip, grouped = batch_size * _MEGA, batch_size * _STRIP, []
        for s in range(0, n_pairs, mega):
            by_prompt = sorted(order[s:s + mega], key=lambda i: lengths[i][0])
            for t in range(0, len(by_prompt), strip):
                grouped += sorted(by_prompt[t:t + strip], key=lambda i: lengths[i][1])
        order = grouped
    batches = [order[s:s + batch_size] for s in range(0, n_pairs - batch_size + 1, batch_size)]
    if lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    per_rank = batch_size // world_size
    return [batch[rank * per_rank:(rank + 1) * per_rank] for batch in batches]


def build_eval_batches(n_pairs: int, micro_batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's pair indices per forward for a pass over every pair exactly once (evaluation, reference
    precompute): disjoint strided slices. Every rank gets the same number of batches; a rank that runs out
    gets empty ones, for which the caller runs a zero-weight dummy so collectives stay in step."""
    mine = list(range(rank, n_pairs, world_size))
    n_batches = -(-(-(-n_pairs // world_size)) // micro_batch_size)  # ceil(ceil(n / world) / micro)
    return [mine[b * micro_batch_size:(b + 1) * micro_batch_size] for b in range(n_batches)]


# 256 batches per mega-batch in 16 strips: 0.92 of tokens are real on pairs with prompts of 10-400 tokens and
# responses of 20-400 (chosen and rejected within 25% of each other), against 0.53 without grouping.
_MEGA, _STRIP = 256, 16
