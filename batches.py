"""Token batches for preference training: each step's rows, each rank's share, and their tensors.

Copyable on its own: imports only the standard library and torch.

A row is {"prompt", "responses", "scores"}: a prompt's token ids, its K responses' (each ending with
EOS) and their scores, higher better; a preference pair is a row of 2 scored (1, 0). `rows.lengths`
is the (N, 1 + K) tensor of their lengths, `rows.scores` the (N, K) scores, NaN past a row's own K
(data.RowTokens). This runs as written:

    import torch
    import torch.distributed as dist
    from batches import BatchConfig, StepBatches, micro_batch_groups, micro_batches, response_table


    class Rows(list):  # data.RowTokens' rows[i] and lengths, as these functions read them
        lengths = torch.tensor(
            [[3, 3, 2, 0], [2, 2, 3, 2], [4, 2, 2, 0], [2, 2, 2, 3]], device="cpu"
        )


    pair = {"prompt": [5, 6, 7], "responses": [[8, 9, 1], [10, 1]], "scores": [1.0, 0.0]}  # EOS 1
    rows = Rows(
        [
            pair,
            {"prompt": [5, 6], "responses": [[7, 1], [8, 9, 1], [6, 1]], "scores": [0.2, 0.9, 0.5]},
            {"prompt": [6, 7, 8, 9], "responses": [[5, 1], [7, 1]], "scores": [1.0, 0.0]},
            {"prompt": [7, 5], "responses": [[8, 1], [6, 1], [9, 7, 1]], "scores": [0.0, 0.3, 0.7]},
        ]
    )
    config = BatchConfig(batch_size=4, micro_batch_size=2).resolve(world_size=1)
    # Rows [prompt | r1 | ... | rK] (--share-prompt), padded with id 0.
    layout = config.layout(pad_id=0, best_only=False, score_prompts=False)
    steps = StepBatches(rows.lengths, config, seed=0)
    for step in range(steps.total_steps):
        batch = steps(step)  # the global batch: row indices
        # This rank's micro-batches of the step: --micro-batch-size rows each (or with --packing,
        # at most --micro-batch-tokens tokens each, end to end).
        groups = micro_batch_groups(rows, batch, rank=0, world_size=1, config=config)
        for idx, rb in micro_batches(rows, groups, "cpu", layout):
            # rb: a RowBatch; its pairs as (preferred, other) among its R responses.
            pairs = list(zip(rb.chosen_index.tolist(), rb.rejected_index.tolist()))
            print(idx, tuple(rb.input_ids.shape), pairs)
    # A value per response, for every row once over all ranks (the reference's log-probs; here
    # each response's scored tokens): (N, K), 0 past a row's own. A collective, as row_table is
    # (any fn(idx, rb) -> (B, *shape)).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(response_table(rows, lambda rb: rb.response_lengths.float(), False, 2, "cpu", layout))
    dist.destroy_process_group()
"""

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
import torch.distributed as dist

# Batches per length-sorted mega-batch: enough for neighbours of similar length, few enough to keep
# an epoch random.
_MEGA = 256


@dataclass
class BatchConfig:
    batch_size: int = 32
    """Global rows per optimizer step, over all ranks and accumulation steps: a pair file's rows
    are pairs, a file of K scored responses per prompt has a row per prompt."""
    micro_batch_size: int | Literal["auto"] | None = None
    """Rows per rank per forward. Default: batch-size / ranks. Accumulation = batch / (micro x
    ranks). auto: the largest that the memory plan says fits the GPU (or --gpu-memory)."""
    pairs: Literal["all", "best-vs-rest", "best-vs-worst"] = "all"
    """The pairs a row of K scored responses gives: every two with different scores, the best
    against each one scored lower, or against the lowest (SimPO's recipe). all, as every response
    is scored once whatever the pairs: each comparison the scores state, at no extra forward. Ties
    never pair; a pair file's rows give their one pair under any."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means --epochs full passes over the data."""
    epochs: int = 1
    """Passes over the training data, when --max-steps is 0."""
    group_by_length: bool = True
    """Batch rows of similar length together (sorted within mega-batches, batch order shuffled):
    less padding."""
    share_prompt: bool = True
    """Score a prompt's responses in one row, [prompt | r1 | ... | rK], the prompt computed once
    (each response sees the prompt and itself only). --no-share-prompt: a row per response. The
    same batches either way."""
    packing: bool = False
    """Lay each micro-batch's rows end to end in one sequence, with no padding (each response still
    sees its own prompt and itself only, at the positions it has alone): training micro-batches are
    then counted in tokens (--micro-batch-tokens), packed greedily from the step's rows in order;
    evaluation's and --ref precompute's micro-batches of --micro-batch-size rows are packed too."""
    micro_batch_tokens: int | Literal["auto"] = 4096
    """With --packing: the most tokens in one training micro-batch (a row longer goes alone). auto:
    the packed length of the most rows that the memory plan says fit the GPU (or --gpu-memory)."""

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")
        if self.micro_batch_tokens == "auto" and not self.packing:
            raise ValueError("--micro-batch-tokens auto sizes packed micro-batches: add --packing")
        if self.micro_batch_tokens != "auto" and self.micro_batch_tokens < 1:
            raise ValueError(f"--micro-batch-tokens must be >= 1, got {self.micro_batch_tokens}")

    def resolve(self, world_size: int, shares_prompt: bool = True) -> "BatchConfig":
        """This config with --micro-batch-size's default for `world_size` ranks (ValueError unless
        they split evenly; auto is kept, for the caller to choose), and --share-prompt only where
        the model and loss can (`shares_prompt`)."""
        micro = (
            self.batch_size // world_size
            if self.micro_batch_size is None
            else self.micro_batch_size
        )
        # auto divides the rows each rank takes: that many must be whole.
        whole = 1 if micro == "auto" else micro
        if whole < 1 or self.batch_size % (whole * world_size):
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of --micro-batch-size "
                f"({micro}, at least 1) x {world_size} ranks"
            )
        return replace(
            self, micro_batch_size=micro, share_prompt=self.share_prompt and shares_prompt
        )

    def layout(self, pad_id: int, best_only: bool, score_prompts: bool) -> "Layout":
        """This config's Layout of rows, with the loss's: `best_only` (SFT alone), `score_prompts`
        (ORPO)."""
        return Layout(pad_id, self.share_prompt, self.pairs, best_only, score_prompts, self.packing)


@dataclass
class RowBatch:
    """B rows of a prompt and its scored responses, laid out as right-padded rows, with the pairs
    they give and the N response tokens that are scored. Separate rows (position_ids None): a row
    per response; padding only ever follows a row's real tokens, which a causal model never lets
    them see, so the model needs no attention mask (its fused causal kernels run). Shared rows: a
    row per prompt, [prompt | r1 | ... | rK], whose attention mask the model must be given
    (logps.response_logps builds it from segment_ids and position_ids). Either way the R responses
    come column after column (every row's first, then every row's second, ...: a pair file's
    chosen, then its rejected), and so do their scored tokens. Built on the host; `.to(device)`
    moves it."""

    input_ids: torch.Tensor
    """(layout rows, T) int64: prompt and response ids, then padding."""
    attention_mask: torch.Tensor
    """(layout rows, T) int64: 1 on real tokens (for counting them; the model is not given it)."""
    response_lengths: torch.Tensor
    """(R,) int64: scored tokens per response."""
    score_index: torch.Tensor
    """(N,) int64: for each scored token, the flat (layout rows * T) position whose state predicts
    it."""
    score_targets: torch.Tensor
    """(N,) int64: the scored tokens, response after response (response_lengths[r] of the r-th)."""
    chosen_index: torch.Tensor
    """(P,) int64: each pair's preferred response, an index into the R responses (SFT alone's
    best_only: each row's response, paired with itself)."""
    rejected_index: torch.Tensor
    """(P,) int64: each pair's other response, scored lower."""
    pair_tokens: int
    """Tokens of both responses summed over the pairs (LD-DPO rescores each response per pair)."""
    response_rows: torch.Tensor
    """(R,) int64: the row (0..B-1) each response belongs to."""
    response_columns: torch.Tensor
    """(R,) int64: each response's place in its row's responses as the data has them."""
    scores: torch.Tensor
    """(B, K) float32: each row's scores, K its most responses, NaN past a row's own."""
    margins: torch.Tensor
    """(P,) float32: each pair's row's "margin" (a reward model's, TRL's), 0 where it has none."""
    position_ids: torch.Tensor | None = None
    """Shared rows: (B, T) int64, each response's positions starting where the prompt ends."""
    segment_ids: torch.Tensor | None = None
    """Shared rows: (B, T) int64, 0 on the prompt, k on the k-th response, -1 on padding. A token
    sees the earlier tokens of the prompt and of its own segment."""
    document_ids: torch.Tensor | None = None
    """Packed rows: (1, T) int64, the layout row each token belongs to; a token sees only its own
    layout row's tokens (and there, as segment_ids say)."""
    desirable: torch.Tensor | None = None
    """(R - mismatched,) bool: each scored response's label for an unpaired loss (labels)."""
    mismatched: int = 0
    """How many of the R responses, the last ones, are KTO's mismatched completions: a row's
    responses past its scores (data.with_mismatched), for the KL estimate alone."""
    scored_prompts: int = 0
    """ORPO's: B where each row's prompt is scored too, its tokens but the first, after the R
    responses (response_lengths and the scored tokens hold B more segments); else 0."""
    parts: tuple | None = None
    """With mismatched completions: (the rows with their scored responses alone, the rows with
    their mismatched ones alone), RowBatches the models run apart (logps.response_logps), the
    second without gradients; this batch's own rows say where each response's values go."""

    def pair_sides(self, values: torch.Tensor) -> torch.Tensor:
        """(2P,) [chosen; rejected] of the pairs from (R,) per-response values."""
        return values[torch.cat([self.chosen_index, self.rejected_index])]

    def pair_prompts(self, values: torch.Tensor) -> torch.Tensor:
        """(P,) each pair's prompt's value from the (B,) per-row values that follow the R
        responses' in (R + B,) ones (scored_prompts)."""
        return values[len(self.response_rows) :][self.response_rows[self.chosen_index]]

    def by_row(self, values: torch.Tensor) -> torch.Tensor:
        """(B, K) float32 from (R,) per-response values: each at its row and column, 0 past a
        row's own responses."""
        table = torch.zeros(self.scores.shape, device=values.device)
        return table.index_put((self.response_rows, self.response_columns), values.float())

    def to(self, device: torch.device) -> "RowBatch":
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.parts:
            moved["parts"] = tuple(part.to(device) for part in self.parts)
        return replace(self, **moved)


@dataclass
class Layout:
    """How a run lays out its rows as RowBatches: collate_rows' options, fixed for the run."""

    pad_id: int
    """Any id does: padding is never attended to nor scored."""
    share_prompt: bool = False
    """A row per prompt, [prompt | r1 | ... | rK]; else a row per response."""
    pairs: str = "all"
    """Which pairs a row gives (row_pairs)."""
    best_only: bool = False
    """SFT alone: each row's best response alone, paired with itself."""
    score_prompts: bool = False
    """ORPO: each prompt's tokens but its first are scored too, after the responses'."""
    packing: bool = False
    """All of a batch's layout rows end to end in one sequence, without padding."""

    def collate(self, rows: list[dict]) -> RowBatch:
        """collate_rows of `rows` in this layout, on the host."""
        return collate_rows(
            rows,
            self.pad_id,
            self.share_prompt,
            self.pairs,
            self.best_only,
            self.score_prompts,
            self.packing,
        )


def row_pairs(scores: list[float], pairs: str = "all") -> list[tuple[int, int]]:
    """(preferred, other) response positions of the pairs a row with these scores gives (NaN: no
    response): every two with different scores ("all"), the best against each scored lower
    ("best-vs-rest"), or against the lowest ("best-vs-worst"). Ties never pair; of tied bests or
    worsts the first counts."""
    real = [i for i, s in enumerate(scores) if not math.isnan(s)]
    if pairs == "all":
        ordered = [(i, j) for n, i in enumerate(real) for j in real[n + 1 :]]
        return [
            (i, j) if scores[i] > scores[j] else (j, i)
            for i, j in ordered
            if scores[i] != scores[j]
        ]
    best = best_response(scores)
    lower = [j for j in real if scores[j] < scores[best]]
    if pairs == "best-vs-worst":
        lower = [min(lower, key=scores.__getitem__)] if lower else []
    return [(best, j) for j in lower]


def labels(scores: list[float]) -> list[bool]:
    """Whether each of a row's responses is desirable, for an unpaired loss (kto): scored above
    the row's mean; in a row of one score (an unpaired file's, whose scores are its labels, 1 or
    0), scored 1. A pair file's chosen responses are desirable, its rejected ones not."""
    mean = sum(scores) / len(scores)
    if min(scores) == max(scores):
        return [s == 1 for s in scores]
    return [s > mean for s in scores]


def response_labels(scores: torch.Tensor) -> list[bool]:
    """Each response's label (labels), row after row, of (N, K) scores, NaN past a row's own."""
    rows = [[s for s in row if not math.isnan(s)] for row in scores.tolist()]
    return [label for row in rows for label in labels(row)]


def best_response(scores: list[float]) -> int:
    """The position of a row's best-scored response (the first of tied bests)."""
    return max((i for i, s in enumerate(scores) if not math.isnan(s)), key=scores.__getitem__)


def collate_rows(
    rows: list[dict],
    pad_id: int,
    share_prompt: bool = False,
    pairs: str = "all",
    best_only=False,
    score_prompts=False,
    packing=False,
) -> RowBatch:
    """Lay out B rows ({"prompt", "responses", "scores"}) as a RowBatch on the host (RowBatch.to
    moves it): a row per response [prompt | response], or with `share_prompt` a row per prompt
    [prompt | r1 | ... | rK]; T the longest. `pairs`: which pairs each row gives (row_pairs);
    `best_only` (SFT): each row's best response alone, paired with itself; `score_prompts`
    (ORPO): each prompt's tokens but its first scored too, after the responses' (scored_prompts);
    `packing`: the layout rows end to end in one row, T their total, without padding
    (document_ids)."""
    host = torch.device("cpu")
    # The scored responses each row lays out, and its pairs as (preferred, other) columns.
    if best_only:
        # SFT alone: each row's best response stands for its one pair, against itself.
        kept = [[best_response(row["scores"])] for row in rows]
        found = [(b, (ks[0], ks[0])) for b, ks in enumerate(kept)]
    else:
        kept = [list(range(len(row["scores"]))) for row in rows]
        found = [(b, ij) for b, row in enumerate(rows) for ij in row_pairs(row["scores"], pairs)]
    # KTO's mismatched completions: a row's responses past its scores.
    extra = [list(range(len(row["scores"]), len(row["responses"]))) for row in rows]
    # (row, column) of the R responses, column after column: a pair file's are all its chosen
    # responses, then all its rejected ones; then the mismatched ones, alike.
    responses = [
        (b, ks[n])
        for group in (kept, extra)
        for n in range(max(map(len, group)))
        for b, ks in enumerate(group)
        if n < len(ks)
    ]
    mismatched = sum(map(len, extra))
    kept = [ks + more for ks, more in zip(kept, extra)]
    # Each layout row: its prompt's row, then the responses it holds.
    layout = [(b, [(b, k) for k in ks]) for b, ks in enumerate(kept)]
    if not share_prompt:
        layout = [(b, [(b, k)]) for b, k in responses]
    sizes = [
        len(rows[b]["prompt"]) + sum(len(rows[b]["responses"][k]) for _, k in held)
        for b, held in layout
    ]
    # Where each layout row starts, (row, column): a row each, or packed end to end in row 0.
    places = [(r, 0) for r in range(len(layout))]
    shape = (len(layout), max(sizes))
    if packing:
        places = [(0, sum(sizes[:r])) for r in range(len(layout))]
        shape = (1, sum(sizes))
    input_ids = torch.full(shape, pad_id, dtype=torch.long, device=host)
    # Padding is its own segment and document, at position 0 (any position the model has would do).
    segment_ids = torch.full(shape, -1, dtype=torch.long, device=host)
    document_ids = torch.full(shape, -1, dtype=torch.long, device=host)
    position_ids = torch.zeros(shape, dtype=torch.long, device=host)
    # Each response's scored positions: its first token is predicted by the prompt's last
    # position, the others by the response's own tokens.
    index = {}
    for r, (b, held) in enumerate(layout):
        prompt = rows[b]["prompt"]
        row, start = places[r]
        flat = row * shape[1]
        if score_prompts and (b, None) not in index:
            # ORPO's NLL: the prompt's tokens but its first, on the prompt's first layout row.
            index[b, None] = list(range(flat + start, flat + start + len(prompt) - 1))
        prompt_last = flat + start + len(prompt) - 1
        for segment, tokens in enumerate([prompt, *(rows[b]["responses"][k] for _, k in held)]):
            end = start + len(tokens)
            input_ids[row, start:end] = torch.tensor(tokens, device=host)
            segment_ids[row, start:end] = segment
            document_ids[row, start:end] = r
            # Responses start where the prompt ends (their segment's first position, shared).
            first = min(segment, 1) * len(prompt)
            position_ids[row, start:end] = torch.arange(first, first + len(tokens), device=host)
            # An empty response (never one of data.py's) scores nothing.
            if segment:
                scored = [prompt_last, *range(flat + start, flat + end - 1)]
                index[held[segment - 1]] = scored if tokens else []
            start = end
    # Each response's place among the R, to turn a row's pairs into indices of responses.
    place = {response: n for n, response in enumerate(responses)}
    chosen = [place[b, i] for b, (i, _) in found]
    rejected = [place[b, j] for b, (_, j) in found]
    parts = None
    if mismatched:
        parts = tuple(
            collate_rows(
                [{**row, "responses": kept} for row, kept in zip(rows, group)],
                pad_id,
                share_prompt,
                packing=packing,
            )
            for group in (
                [row["responses"][: len(row["scores"])] for row in rows],
                [row["responses"][len(row["scores"]) :] for row in rows],
            )
        )
    # The scored segments: the responses, then (score_prompts) each row's prompt.
    segments = [(rows[b]["responses"][k], index[b, k]) for b, k in responses]
    if score_prompts:
        segments += [(rows[b]["prompt"][1:], index[b, None]) for b in range(len(rows))]
    return RowBatch(
        input_ids,
        (segment_ids >= 0).long(),
        torch.tensor([len(tokens) for tokens, _ in segments], device=host),
        torch.tensor([i for _, at in segments for i in at], device=host),
        torch.tensor([t for tokens, _ in segments for t in tokens], device=host),
        torch.tensor(chosen, dtype=torch.long, device=host),
        torch.tensor(rejected, dtype=torch.long, device=host),
        sum(len(rows[b]["responses"][i]) + len(rows[b]["responses"][j]) for b, (i, j) in found),
        torch.tensor([b for b, _ in responses], device=host),
        torch.tensor([k for _, k in responses], device=host),
        torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(row["scores"], dtype=torch.float32, device=host) for row in rows],
            batch_first=True,
            padding_value=math.nan,
        ),
        torch.tensor([rows[b].get("margin", 0.0) for b, _ in found], device=host),
        position_ids if share_prompt or packing else None,
        segment_ids if share_prompt or packing else None,
        document_ids if packing else None,
        torch.tensor(
            [labels(rows[b]["scores"])[k] for b, k in responses[: len(responses) - mismatched]],
            dtype=torch.bool,
            device=host,
        ),
        mismatched,
        len(rows) if score_prompts else 0,
        parts,
    )


class StepBatches:
    """Every optimizer step's global batch of row indices, epoch after epoch (split it with
    rank_share). Each epoch's order is a function of (seed, epoch) alone (build_batches), so a
    resumed run sees what it would have."""

    def __init__(self, row_lens: torch.Tensor, config: BatchConfig, seed: int):
        self.config = config
        self.seed = seed
        self.n_rows = len(row_lens)
        self.lengths = row_lengths(row_lens) if config.group_by_length else None
        self.steps_per_epoch = self.n_rows // config.batch_size
        if not self.steps_per_epoch:
            raise ValueError(
                f"{self.n_rows} training rows, fewer than one --batch-size ({config.batch_size})"
            )
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        # {epoch: its batches} of the current epoch alone, made when a step first needs them.
        self._batches = {}

    def __call__(self, step: int) -> list[int]:
        epoch = step // self.steps_per_epoch
        if epoch not in self._batches:
            self._batches = {
                epoch: build_batches(
                    self.n_rows, self.config.batch_size, self.seed, epoch, self.lengths
                )
            }
        return self._batches[epoch][step % self.steps_per_epoch]


def row_lengths(row_lens: torch.Tensor) -> list[int]:
    """Each row's tokens from its (N, 1 + K) [prompt, r1, ..., rK] lengths: its shared row's
    length, the key of length grouping in either layout, so that --share-prompt changes no
    batch."""
    return row_lens.sum(1).tolist()


def pair_counts(rows, idx: list[int], layout: Layout) -> tuple[int, int]:
    """(pairs, their preferred responses' tokens) of rows[idx] (data.RowTokens: its scores and
    lengths) in `layout`, on the host with no forward: what a step's means are over. best_only (SFT
    alone): each row's best response stands for its one pair. score_prompts (ORPO, whose NLL counts
    them too): each pair's prompt tokens but the first count among its preferred tokens."""
    count = tokens = 0
    for i in idx:
        lengths = rows.lengths[i].tolist()
        scores = rows.scores[i].tolist()
        found = (
            [(best_response(scores), None)] if layout.best_only else row_pairs(scores, layout.pairs)
        )
        count += len(found)
        prompt = layout.score_prompts * (lengths[0] - 1)
        tokens += sum(lengths[1 + c] + prompt for c, _ in found)
    return count, tokens


def build_batches(
    n_rows: int, batch_size: int, seed: int, epoch: int, lengths: list[int] | None = None
) -> list[list[int]]:
    """The row indices of each optimizer step of one epoch over all ranks (split them with
    rank_share), a shuffle seeded by (seed, epoch). With `lengths` (row_lengths), each mega-batch
    of _MEGA global batches is sorted by length and cut into batches, whose order is shuffled again:
    rows of similar length, batches in random order. A last partial batch is dropped, so every step
    sees exactly batch_size rows."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_rows, generator=generator).tolist()
    if lengths is not None:
        mega = batch_size * _MEGA
        order = [
            i
            for s in range(0, n_rows, mega)
            for i in sorted(order[s : s + mega], key=lengths.__getitem__)
        ]
    batches = [order[s : s + batch_size] for s in range(0, n_rows - batch_size + 1, batch_size)]
    if lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def longest_rows(rows, size: int, among: list[int] | None = None) -> list[int]:
    """The `size` rows of `rows` (data.RowTokens), or of its rows `among`, with the most tokens
    (row_lengths): the largest micro-batch of that size a step of them can hold."""
    lengths = row_lengths(rows.lengths)
    candidates = range(len(lengths)) if among is None else among
    return sorted(candidates, key=lengths.__getitem__)[-size:]


def rank_share(batch: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s contiguous, disjoint slice of a global batch."""
    if len(batch) % world_size:
        raise ValueError(f"batch size {len(batch)} is not divisible by {world_size} ranks")
    per_rank = len(batch) // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def micro_batch_groups(
    rows, batch: list[int], rank: int, world_size: int, config: BatchConfig
) -> list[list[int]]:
    """Rank `rank`'s micro-batches of the global `batch` of indices into `rows` (data.RowTokens).
    Unpacked: its rank_share, --micro-batch-size rows at a time. Packed: the batch's rows, in order,
    greedily into micro-batches of at most --micro-batch-tokens tokens as laid out;
    the micro-batch of most rows split in two until every rank gets as many (their FSDP collectives
    pair up); then dealt round by round, the largest first."""
    if not config.packing:
        mine = rank_share(batch, rank, world_size)
        return [
            mine[s : s + config.micro_batch_size]
            for s in range(0, len(mine), config.micro_batch_size)
        ]
    # Each row's tokens as laid out: one shared row, or a row per response, each with the prompt.
    responses = rows.lengths[batch][:, 1:]  # (B, K), 0 past a row's own K
    prompts = rows.lengths[batch][:, 0] * (1 if config.share_prompt else (responses > 0).sum(1))
    tokens = dict(zip(batch, (prompts + responses.sum(1)).tolist()))
    packs = [[]]
    for i in batch:
        if packs[-1] and sum(tokens[j] for j in packs[-1]) + tokens[i] > config.micro_batch_tokens:
            packs.append([])
        packs[-1].append(i)
    # The batch's rows are a multiple of the ranks: splitting ends at one row each, at the latest.
    while len(packs) % world_size:
        most = max(packs, key=len)
        at = packs.index(most)
        packs[at : at + 1] = [most[: len(most) // 2], most[len(most) // 2 :]]
    # Dealt from the largest down, a round at a time: nearly equal token work on every rank.
    return sorted(packs, key=lambda p: -sum(tokens[i] for i in p))[rank::world_size]


def micro_batches(rows, groups: list[list[int]], device, layout: Layout):
    """(indices, RowBatch on `device`) for each micro-batch (`groups` of indices into rows), in
    order."""
    for idx in groups:
        yield idx, layout.collate([rows[i] for i in idx]).to(device)


def row_table(
    rows, shape: tuple, fn, micro_batch_size: int, device, layout: Layout
) -> torch.Tensor:
    """(N, *shape): fn(idx, batch) -> (B, *shape) for each row exactly once over the process
    group's ranks, shortest first (build_eval_batches; `rows`: data.RowTokens). A collective: every
    rank calls it and gets the whole table."""
    # Each row from one rank, 0 on the others: the sum over ranks is exact, one non-zero term each.
    table = torch.zeros(len(rows), *shape, device=device)
    for idx in build_eval_batches(
        len(rows),
        micro_batch_size,
        dist.get_rank(),
        dist.get_world_size(),
        row_lengths(rows.lengths),
    ):
        # A rank out of rows runs a dummy (row 0), for the collectives, and keeps nothing of it.
        batch = layout.collate([rows[i] for i in idx or [0]]).to(device)
        table[idx] = fn(idx, batch)[: len(idx)]
    dist.all_reduce(table)
    return table


def response_table(
    rows, fn, per_pair: bool, micro_batch_size: int, device, layout: Layout
) -> torch.Tensor:
    """A row_table of fn(batch)'s values: (N, K) from (R,) per-response ones, or with `per_pair`
    (N, K, K) from (2P,) [chosen; rejected] pair sides (LD-DPO's, which depend on the pair): entry
    [row, a, b] is response a's against b; K the rows' most responses. table_rows reads it
    back."""
    # A row's responses: its scored ones, then any mismatched ones (data.with_mismatched).
    most = rows.lengths.shape[1] - 1
    shape = (most, most) if per_pair else (most,)

    def entries(idx, batch):  # (B, *shape)
        values = fn(batch)
        table = torch.zeros(len(batch.scores), *shape, device=values.device)
        return table.index_put(_table_index(batch, per_pair), values)

    return row_table(rows, shape, entries, micro_batch_size, device, layout)


def table_rows(table: torch.Tensor, idx: list[int], batch: RowBatch) -> torch.Tensor:
    """`batch`'s values from a response_table of rows `idx`: (R,) per response from an (N, K)
    table, (2P,) [chosen; rejected] pair sides from an (N, K, K) one."""
    mine = table[to_device(torch.tensor(idx or [0], device="cpu"), table.device)]
    return mine[_table_index(batch, per_pair=table.dim() == 3)]


def _table_index(batch: RowBatch, per_pair: bool) -> tuple:
    """A response_table's index of `batch`'s values: (row, column) of each of the (R,) responses,
    or with `per_pair` (row, column, partner's column) of each of the (2P,) [chosen; rejected]
    pair sides."""
    if not per_pair:
        return batch.response_rows, batch.response_columns
    side = torch.cat([batch.chosen_index, batch.rejected_index])
    other = torch.cat([batch.rejected_index, batch.chosen_index])
    return batch.response_rows[side], batch.response_columns[side], batch.response_columns[other]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from the host to a GPU through pinned memory and an asynchronous copy, so
    the host goes on queueing work instead of waiting for a pageable copy in every micro-batch."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_eval_batches(
    n_rows: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """This rank's row indices per forward for a pass over every row once (evaluation, reference
    precompute): disjoint strided slices, sorted by `lengths` when given. Every rank gets the same
    number of batches; one that runs out gets empty ones, for which the caller runs a zero-weight
    dummy so collectives stay in step."""
    order = range(n_rows) if lengths is None else sorted(range(n_rows), key=lengths.__getitem__)
    mine = list(order[rank::world_size])
    per_rank = math.ceil(n_rows / world_size)
    return [mine[b : b + micro_batch_size] for b in range(0, per_rank, micro_batch_size)]
