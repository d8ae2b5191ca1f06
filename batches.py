"""Token batches for preference training: each step's pairs, each rank's share, and their tensors.

Copyable on its own: imports only the standard library and torch.

    steps = StepBatches(pair_lens, BatchConfig(batch_size=64).resolve(world_size), seed=0)
    for step in range(steps.total_steps):
        batch = steps(step)  # the global batch: pair indices
        mine = rank_share(batch, rank, world_size)  # this rank's pairs of the step
        # pb: a PairBatch, (2B, T) rows
        for idx, pb in micro_batches(pairs, mine, 8, pad_id, device):
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

# Labels not scored: Hugging Face's convention, and loss.py's (one line, kept so that this file
# copies alone).
IGNORE_INDEX = -100

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

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")

    def resolve(self, world_size: int) -> "BatchConfig":
        """This config with --micro-batch-size's default for `world_size` ranks; ValueError unless
        they split evenly."""
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of --micro-batch-size "
                f"({micro}) x {world_size} ranks"
            )
        return replace(self, micro_batch_size=micro)


@dataclass
class PairBatch:
    """B preference pairs as 2B right-padded rows, all chosen then all rejected, and the N response
    tokens that are scored. Padding only ever follows a row's real tokens, which a causal model
    never lets them see, so the model needs no attention mask (its fused causal kernels run). Built
    on the host; `.to(device)` moves it."""

    input_ids: torch.Tensor
    """(2B, T) int64: prompt + response ids, then padding."""
    attention_mask: torch.Tensor
    """(2B, T) int64: 1 on real tokens (for counting them; the model is not given it)."""
    labels: torch.Tensor
    """(2B, T) int64: the response ids, IGNORE_INDEX on prompt and padding (Hugging Face's form)."""
    response_lengths: torch.Tensor
    """(2B,) int64: scored tokens per row."""
    score_index: torch.Tensor
    """(N,) int64: for each scored token, the flat (2B * T) position whose state predicts it."""
    score_targets: torch.Tensor
    """(N,) int64: the scored tokens, row after row (response_lengths[r] of row r)."""
    chosen_scored: int
    """How many of the N scored tokens belong to chosen rows (they come first)."""

    def chosen(self) -> "PairBatch":
        """The first B rows alone (SFT scores the chosen responses only)."""
        half = len(self.response_lengths) // 2
        n = self.chosen_scored
        return PairBatch(
            self.input_ids[:half],
            self.attention_mask[:half],
            self.labels[:half],
            self.response_lengths[:half],
            self.score_index[:n],
            self.score_targets[:n],
            n,
        )

    def to(self, device: torch.device) -> "PairBatch":
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in fields(self)
            if f.name != "chosen_scored"
        }
        return replace(self, **moved)


def collate_pairs(pairs: list[dict[str, list[int]]], pad_id: int) -> PairBatch:
    """Lay out B pairs as a PairBatch on the host (PairBatch.to moves it): (2B, T) rows, T the
    longest row."""
    host = torch.device("cpu")
    seqs = [(pair["prompt"], pair[key]) for key in ("chosen", "rejected") for pair in pairs]
    width = max(len(prompt) + len(response) for prompt, response in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=host)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long, device=host)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long, device=host)
    index = []
    targets = []
    for r, (prompt, response) in enumerate(seqs):
        end = len(prompt) + len(response)
        input_ids[r, :end] = torch.tensor(prompt + response, device=host)
        labels[r, len(prompt) : end] = torch.tensor(response, device=host)
        attention_mask[r, :end] = 1
        # The position before each response token predicts it.
        index += range(r * width + len(prompt) - 1, r * width + end - 1)
        targets += response
    return PairBatch(
        input_ids,
        attention_mask,
        labels,
        torch.tensor([len(r) for _, r in seqs], device=host),
        torch.tensor(index, device=host),
        torch.tensor(targets, device=host),
        sum(len(response) for _, response in seqs[: len(pairs)]),
    )


class StepBatches:
    """Every optimizer step's global batch of pair indices, epoch after epoch (split it with
    rank_share). Each epoch's order is a function of (seed, epoch) alone (build_batches), so a
    resumed run sees what it would have."""

    def __init__(self, pair_lens: torch.Tensor, config: BatchConfig, seed: int):
        self.config = config
        self.seed = seed
        self.n_pairs = len(pair_lens)
        self.lengths = pair_lengths(pair_lens) if config.group_by_length else None
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


def pair_lengths(pair_lens: torch.Tensor) -> list[int]:
    """Each pair's collated row length (prompt + longer response) from (N, 3) [prompt, chosen,
    rejected] lengths."""
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


def micro_batches(pairs, idx: list[int], micro_batch_size: int, pad_id: int, device: torch.device):
    """(indices, PairBatch on `device`) for each micro-batch of pairs[idx], in order."""
    for s in range(0, len(idx), micro_batch_size):
        mine = idx[s : s + micro_batch_size]
        yield mine, collate_pairs([pairs[i] for i in mine], pad_id).to(device)


def pair_table(
    pairs, width: int, fn, micro_batch_size: int, pad_id: int, device: torch.device
) -> torch.Tensor:
    """(N, width): fn(idx, batch) -> (B, width) for each pair exactly once over the process group's
    ranks, shortest first (build_eval_batches; `pairs`: data.PairTokens). A collective: every rank
    calls it and gets the whole table."""
    # Each row from one rank, 0 on the others: the sum over ranks is exact, one non-zero term each.
    table = torch.zeros(len(pairs), width, device=device)
    lengths = pair_lengths(pairs.lengths)
    for idx in build_eval_batches(
        len(pairs), micro_batch_size, dist.get_rank(), dist.get_world_size(), lengths
    ):
        # A rank out of pairs runs a dummy (pair 0), for the collectives, and keeps nothing of it.
        batch = collate_pairs([pairs[i] for i in idx or [0]], pad_id).to(device)
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
