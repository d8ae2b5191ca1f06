"""Token batches for preference training: each step's pairs, each rank's share, and their tensors.

Copyable on its own: imports only the standard library and torch.

    steps = StepBatches(pair_lens, BatchConfig(batch_size=64).resolve(world_size), seed=0)
    for step in range(steps.total_steps):
        batch = steps(step)  # the global batch: pair indices
        mine = rank_share(batch, rank, world_size)  # this rank's pairs of the step
        # pb: a PairBatch, B rows [prompt | chosen | rejected] (share_prompt=False: 2B rows)
        for idx, pb in micro_batches(pairs, mine, 8, pad_id, device, share_prompt=True):
            ...
    # fn(idx, pb) -> (B, 2), for every pair once over all ranks
    table = pair_table(pairs, 2, fn, 8, pad_id, device)

A pair is {"prompt", "chosen", "rejected"}: lists of token ids, each response ending with EOS.
`pair_lens` is the (N, 3) tensor of their lengths (data.PairTokens.lengths).
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

# Batches per length-sorted mega-batch: enough for neighbours of similar length, few enough to keep
# an epoch random.
_MEGA = 256


@dataclass
class BatchConfig:
    batch_size: int = 32
    """Global preference pairs per optimizer step, over all ranks and accumulation steps."""
    micro_batch_size: int | None = None
    """Pairs per rank per forward (2x rows). Default: batch-size / ranks. Accumulation = batch /
    (micro x ranks)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means --epochs full passes over the data."""
    epochs: int = 1
    """Passes over the training data, when --max-steps is 0."""
    group_by_length: bool = True
    """Batch pairs of similar length together (sorted within mega-batches, batch order shuffled):
    less padding."""
    share_prompt: bool = True
    """Score each pair in one row, [prompt | chosen | rejected], the prompt computed once (the
    rejected tokens see the prompt and themselves only). --no-share-prompt: a row per response."""

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")

    def resolve(self, world_size: int, shares_prompt: bool = True) -> "BatchConfig":
        """This config with --micro-batch-size's default for `world_size` ranks (ValueError unless
        they split evenly), and --share-prompt only where the model and loss can
        (`shares_prompt`)."""
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of --micro-batch-size "
                f"({micro}) x {world_size} ranks"
            )
        return replace(
            self, micro_batch_size=micro, share_prompt=self.share_prompt and shares_prompt
        )


@dataclass
class PairBatch:
    """B preference pairs as right-padded rows, and the N response tokens that are scored. Separate
    rows (position_ids None): 2B rows, all chosen then all rejected; padding only ever follows a
    row's real tokens, which a causal model never lets them see, so the model needs no attention
    mask (its fused causal kernels run). Shared rows: B rows [prompt | chosen | rejected], whose
    attention mask the model must be given (loss.response_logps builds it from segment_ids and
    position_ids). Either way the scored tokens and their log-probs are in [chosen; rejected]
    order. Built on the host; `.to(device)` moves it."""

    input_ids: torch.Tensor
    """(rows, T) int64: prompt and response ids, then padding."""
    attention_mask: torch.Tensor
    """(rows, T) int64: 1 on real tokens (for counting them; the model is not given it)."""
    response_lengths: torch.Tensor
    """(2B,) int64: scored tokens per response, all chosen then all rejected."""
    score_index: torch.Tensor
    """(N,) int64: for each scored token, the flat (rows * T) position whose state predicts it."""
    score_targets: torch.Tensor
    """(N,) int64: the scored tokens, response after response (response_lengths[r] of the r-th)."""
    chosen_scored: int
    """How many of the N scored tokens belong to chosen responses (they come first)."""
    position_ids: torch.Tensor | None = None
    """Shared rows: (B, T) int64, each response's positions starting where the prompt ends."""
    segment_ids: torch.Tensor | None = None
    """Shared rows: (B, T) int64, 0 on the prompt, 1 on chosen, 2 on rejected, -1 on padding. A
    token sees the earlier tokens of the prompt and of its own segment."""

    def chosen(self) -> "PairBatch":
        """The chosen responses alone (SFT scores no others): separate rows' first B rows; shared
        rows all stay, only their chosen tokens scored."""
        half = len(self.response_lengths) // 2
        n = self.chosen_scored
        rows = half if self.position_ids is None else len(self.input_ids)
        return replace(
            self,
            input_ids=self.input_ids[:rows],
            attention_mask=self.attention_mask[:rows],
            response_lengths=self.response_lengths[:half],
            score_index=self.score_index[:n],
            score_targets=self.score_targets[:n],
        )

    def to(self, device: torch.device) -> "PairBatch":
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def collate_pairs(
    pairs: list[dict[str, list[int]]], pad_id: int, share_prompt: bool = False
) -> PairBatch:
    """Lay out B pairs as a PairBatch on the host (PairBatch.to moves it): 2B rows [prompt |
    response], or with `share_prompt` B rows [prompt | chosen | rejected]; T the longest row."""
    host = torch.device("cpu")
    keys = ("chosen", "rejected")
    if share_prompt:
        rows = [[pair["prompt"], pair["chosen"], pair["rejected"]] for pair in pairs]
    else:
        rows = [[pair["prompt"], pair[key]] for key in keys for pair in pairs]
    width = max(sum(map(len, row)) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=host)
    # Padding is its own segment, at position 0 (any position the model has would do).
    segment_ids = torch.full((len(rows), width), -1, dtype=torch.long, device=host)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long, device=host)
    # Each key's scored positions: a response's first token is predicted by the prompt's last
    # position, the others by the response's own tokens.
    index = {key: [] for key in keys}
    for r, (prompt, *responses) in enumerate(rows):
        start = 0
        for segment, tokens in enumerate([prompt, *responses]):
            end = start + len(tokens)
            input_ids[r, start:end] = torch.tensor(tokens, device=host)
            segment_ids[r, start:end] = segment
            # Responses start where the prompt ends (their segment's first position, shared).
            first = min(segment, 1) * len(prompt)
            position_ids[r, start:end] = torch.arange(first, first + len(tokens), device=host)
            # An empty response (never one of data.py's) scores nothing.
            if segment and tokens:
                key = keys[segment - 1] if share_prompt else keys[r // len(pairs)]
                flat = r * width
                index[key] += [flat + len(prompt) - 1, *range(flat + start, flat + end - 1)]
            start = end
    return PairBatch(
        input_ids,
        (segment_ids >= 0).long(),
        torch.tensor([len(pair[key]) for key in keys for pair in pairs], device=host),
        torch.tensor(index["chosen"] + index["rejected"], device=host),
        torch.tensor([t for key in keys for pair in pairs for t in pair[key]], device=host),
        len(index["chosen"]),
        position_ids if share_prompt else None,
        segment_ids if share_prompt else None,
    )


class StepBatches:
    """Every optimizer step's global batch of pair indices, epoch after epoch (split it with
    rank_share). Each epoch's order is a function of (seed, epoch) alone (build_batches), so a
    resumed run sees what it would have."""

    def __init__(self, pair_lens: torch.Tensor, config: BatchConfig, seed: int):
        self.config = config
        self.seed = seed
        self.n_pairs = len(pair_lens)
        self.lengths = None
        if config.group_by_length:
            self.lengths = pair_lengths(pair_lens, config.share_prompt)
        self.steps_per_epoch = self.n_pairs // config.batch_size
        if not self.steps_per_epoch:
            raise ValueError(
                f"{self.n_pairs} training pairs, fewer than one --batch-size ({config.batch_size})"
            )
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        # The current epoch's batches, made when a step first needs them.
        self._epoch = -1
        self._batches = []

    def __call__(self, step: int) -> list[int]:
        epoch = step // self.steps_per_epoch
        if self._epoch != epoch:
            self._epoch = epoch
            self._batches = build_batches(
                self.n_pairs, self.config.batch_size, self.seed, epoch, self.lengths
            )
        return self._batches[step % self.steps_per_epoch]


def pair_lengths(pair_lens: torch.Tensor, share_prompt: bool = False) -> list[int]:
    """Each pair's collated row length from (N, 3) [prompt, chosen, rejected] lengths: prompt +
    longer response, or shared, all three."""
    if share_prompt:
        return pair_lens.sum(1).tolist()
    return (pair_lens[:, 0] + pair_lens[:, 1:].amax(1)).tolist()


def build_batches(
    n_pairs: int, batch_size: int, seed: int, epoch: int, lengths: list[int] | None = None
) -> list[list[int]]:
    """The pair indices of each optimizer step of one epoch over all ranks (split them with
    rank_share), a shuffle seeded by (seed, epoch). With `lengths` (pair_lengths), each mega-batch
    of _MEGA global batches is sorted by length and cut into batches, whose order is shuffled again:
    pairs of similar length, batches in random order. A last partial batch is dropped, so every step
    sees exactly batch_size pairs."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_pairs, generator=generator).tolist()
    if lengths is not None:
        mega = batch_size * _MEGA
        order = [
            i
            for s in range(0, n_pairs, mega)
            for i in sorted(order[s : s + mega], key=lengths.__getitem__)
        ]
    batches = [order[s : s + batch_size] for s in range(0, n_pairs - batch_size + 1, batch_size)]
    if lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def rank_share(batch: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s contiguous, disjoint slice of a global batch."""
    if len(batch) % world_size:
        raise ValueError(f"batch size {len(batch)} is not divisible by {world_size} ranks")
    per_rank = len(batch) // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def micro_batches(
    pairs, idx: list[int], micro_batch_size: int, pad_id: int, device, share_prompt: bool = False
):
    """(indices, PairBatch on `device`) for each micro-batch of pairs[idx], in order."""
    for s in range(0, len(idx), micro_batch_size):
        mine = idx[s : s + micro_batch_size]
        yield mine, collate_pairs([pairs[i] for i in mine], pad_id, share_prompt).to(device)


def pair_table(
    pairs, width: int, fn, micro_batch_size: int, pad_id: int, device, share_prompt: bool = False
) -> torch.Tensor:
    """(N, width): fn(idx, batch) -> (B, width) for each pair exactly once over the process group's
    ranks, shortest first (build_eval_batches; `pairs`: data.PairTokens). A collective: every rank
    calls it and gets the whole table."""
    # Each row from one rank, 0 on the others: the sum over ranks is exact, one non-zero term each.
    table = torch.zeros(len(pairs), width, device=device)
    lengths = pair_lengths(pairs.lengths, share_prompt)
    for idx in build_eval_batches(
        len(pairs), micro_batch_size, dist.get_rank(), dist.get_world_size(), lengths
    ):
        # A rank out of pairs runs a dummy (pair 0), for the collectives, and keeps nothing of it.
        batch = collate_pairs([pairs[i] for i in idx or [0]], pad_id, share_prompt).to(device)
        table[idx] = fn(idx, batch)[: len(idx)]
    dist.all_reduce(table)
    return table


def table_rows(table: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """(2B,) [chosen; rejected], as in a PairBatch, of pairs `idx` from an (N, 2) [chosen, rejected]
    table."""
    rows = table[to_device(torch.tensor(idx or [0], device="cpu"), table.device)]  # (B, 2)
    return rows.T.reshape(-1)  # (2B,)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from the host to a GPU through pinned memory and an asynchronous copy, so
    the host goes on queueing work instead of waiting for a pageable copy in every micro-batch."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_eval_batches(
    n_pairs: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """This rank's pair indices per forward for a pass over every pair once (evaluation, reference
    precompute): disjoint strided slices, sorted by `lengths` when given. Every rank gets the same
    number of batches; one that runs out gets empty ones, for which the caller runs a zero-weight
    dummy so collectives stay in step."""
    order = range(n_pairs) if lengths is None else sorted(range(n_pairs), key=lengths.__getitem__)
    mine = list(order[rank::world_size])
    per_rank = math.ceil(n_pairs / world_size)
    return [mine[b : b + micro_batch_size] for b in range(0, per_rank, micro_batch_size)]
