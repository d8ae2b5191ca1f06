"""Log-probabilities of response tokens in float32, without a float32 copy of the logits: the
fused, chunked output layer (ScoredHead) and the attention masks of shared-prompt rows.

Copyable on its own: imports only the standard library and torch.

    logps = sequence_logps(logits, labels)  # (B,) float32; labels -100 where not scored

A Hugging Face causal LM can skip the logits: give it a ScoredHead once (before sharding), then
score the responses of rows laid out as ScoredRows describes (batches.RowBatch is one such layout):

    add_scored_head(model)  # state-dict names unchanged
    sums = response_logps(model, rows)  # (R,) float32, one per response

A reward model (a transformers sequence classifier with one label) scores the same rows' responses
at their last tokens, each prompt computed once:

    rewards = response_rewards(reward_model, rows)  # (R,) float32

This runs as written:

    import torch
    from logps import ScoredHead, fused_head, sequence_logps

    logits = torch.randn(2, 5, 32)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 7, 8, -100, -100]], device="cpu")
    print(sequence_logps(logits, labels))  # (2,): tokens 3, 4, 5 and 7, 8
    head = ScoredHead(torch.nn.Linear(8, 32, bias=False), fusable=True)
    hidden = torch.randn(2, 5, 8)  # (B, T, H)
    # The states at flat positions 1, 2, 3 predict tokens 3, 4, 5: (3,) log-probs, no logits.
    index = torch.tensor([1, 2, 3], device="cpu")
    targets = torch.tensor([3, 4, 5], device="cpu")
    with fused_head(), head.scoring(index, targets) as scored:
        head(hidden)
    print(scored.logps)
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

IGNORE_INDEX = -100
# The fused output layer runs on GPUs, where memory is what runs out (long pairs); on a CPU its
# recomputation in backward costs more time than the memory it saves is worth (BENCHMARKS.md).
FUSED_HEAD_ON_CPU = False
# Model config fields that reshape the logits after the output layer: its result must stay logits.
_LOGIT_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class ScoredRows:
    """Rows of token ids and the response tokens to score in them: the layout response_logps
    reads (batches.RowBatch has these fields and more). Separate rows (position_ids None) are
    causal and right-padded, so the model needs no mask; shared rows [prompt | r1 | ... | rK]
    carry positions and segments, from which their mask is built (shared_row_inputs)."""

    input_ids: torch.Tensor
    """(rows, T) int64."""
    score_index: torch.Tensor
    """(N,) int64: for each scored token, the flat (rows * T) position whose state predicts it."""
    score_targets: torch.Tensor
    """(N,) int64: the scored tokens, response after response."""
    response_lengths: torch.Tensor
    """(R,) int64: scored tokens per response, in score_targets' order."""
    position_ids: torch.Tensor | None = None
    """Shared rows: (rows, T) int64, each response's positions starting where the prompt ends."""
    segment_ids: torch.Tensor | None = None
    """Shared rows: (rows, T) int64, 0 on the prompt, k on the k-th response, -1 on padding."""
    document_ids: torch.Tensor | None = None
    """Packed rows: (rows, T) int64, which of the rows laid end to end each token belongs to; a
    token sees no other's."""
    chosen_index: torch.Tensor | None = None
    """LD-DPO only: (P,) int64, each pair's preferred response among the R."""
    rejected_index: torch.Tensor | None = None
    """LD-DPO only: (P,) int64, each pair's other response."""
    pair_tokens: int = 0
    """LD-DPO only: both responses' tokens summed over the pairs (a host int: no sync)."""
    parts: tuple | None = None
    """Or rows scored in two forwards: (rows of the responses to score, rows of more responses
    scored without gradients, after them; KTO's mismatched completions, a constant)."""


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, average: bool = False
) -> torch.Tensor:
    """(B,) float32 sum_t log p(labels_t | <t) per row, or with average=True the mean over counted
    tokens (0 if none). logits: (B, T, V), any float dtype; labels: (B, T) as in Hugging Face (the
    logits at t - 1 score the token at t: the shift happens here), IGNORE_INDEX where not counted.
    No float32 copy of the logits is made: the log-softmax runs chunk by chunk over counted
    positions only, and so does backward (see _TokenLogps)."""
    if logits.shape[:2] != labels.shape or logits.device != labels.device:
        raise ValueError(
            f"logits {tuple(logits.shape)} on {logits.device} and labels {tuple(labels.shape)} on "
            f"{labels.device} must agree on (B, T) and device"
        )
    batch, length = labels.shape
    # Position t of the logits scores label t + 1.
    mask = labels[:, 1:] != IGNORE_INDEX  # (B, T-1)
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each
    flat = logits.reshape(batch * length, -1)  # (B * T, V), a view
    token_logps = _TokenLogps.apply(flat, rows * length + cols, labels[:, 1:][mask], None, False)
    # Each row's tokens are consecutive: summed in order, without index_add_'s atomics, so the same
    # inputs give the same bits.
    total = torch.segment_reduce(token_logps, "sum", lengths=mask.sum(-1), unsafe=True, initial=0)
    if average:
        return total / mask.sum(-1).clamp(min=1)
    return total


def _chunk_rows(vocab: int, device: torch.device, matmul: bool = False) -> int:
    """Rows per float32 (rows, V) chunk. A log-softmax alone on a CPU: a chunk small enough to stay
    in cache. With the output layer's matmul, or on a GPU: large, as small matmuls are slow (at V =
    128k, hundreds of rows)."""
    if device.type == "cpu" and not matmul:
        return max(1, 2**20 // vocab)
    return max(1, 2**26 // vocab)


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits)[targets] in float32, chunk by chunk over the N scored rows, where a row's
    logits are x[index] (index None: x's rows in order), or x's rows through the output layer
    `weight` (V, H) when given. Forward keeps only the (N,) log-sum-exp besides its inputs;
    backward recomputes each chunk's softmax and writes d/dlogits = grad * (onehot(target) -
    softmax) into x's gradient; through `weight`, in chunks of the vocabulary instead
    (_head_backward). So no (N, V) float32 tensor ever exists, nor, with `weight`, any (N, V)
    logits at all. squares=True returns (2N,): then each row's log sum_v p(v)^2 (WPO's), from the
    same logits, which get no gradient through them."""

    @staticmethod
    def forward(ctx, x, index, targets, weight, squares):
        """x: (M, V) logits or (N, H) hidden states; index: (N,) or None, None with weight;
        targets: (N,); weight: (V, H) or None; squares: bool."""
        n = len(targets)
        chunk = _chunk_rows(
            x.shape[-1] if weight is None else len(weight), x.device, matmul=weight is not None
        )
        out = torch.empty(2 * n if squares else n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        for i in range(0, n, chunk):
            end = min(i + chunk, n)
            # The chunk's (end - i, V) logits: x's rows, or those rows through the output layer.
            rows = x[i:end] if index is None else x[index[i:end]]
            # The chunk's float32 logits in a tensor of their own, which the log-sum-exp below works
            # in: a copy of x's rows only where they are still x's (x[index] is a copy already).
            logits = (
                rows.to(torch.float32, copy=index is None)
                if weight is None
                else _product(rows, weight.T).float()
            )
            out[i:end] = logits.gather(-1, targets[i:end, None]).squeeze(-1)
            top = logits.amax(-1, keepdim=True)  # (end - i, 1)
            # In place, exp(logits - top): torch's logsumexp would make that (end - i, V) float32
            # tensor inside itself, a second one beside the logits.
            total = logits.sub_(top).exp_().sum(-1)
            lse[i:end] = total.log() + top.squeeze(-1)
            out[i:end] -= lse[i:end]
            if squares:
                # log sum_v p(v)^2 = log sum_v exp(2 (logits - top)) - 2 log sum_v exp(logits - top)
                out[n + i : n + end] = logits.square_().sum(-1).log_() - 2 * total.log()
        ctx.save_for_backward(x, index, targets, weight, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, index, targets, weight, lse = ctx.saved_tensors
        # No gradient flows through the squares (WPO's weights).
        grad = grad[: len(targets), None]
        if weight is not None:
            return _head_backward(x, targets, weight, lse, grad, ctx.needs_input_grad[3])
        chunk = _chunk_rows(x.shape[-1], x.device)
        grad_x = torch.zeros_like(x)
        for i in range(0, len(targets), chunk):
            rows = slice(i, i + chunk) if index is None else index[i : i + chunk]
            g = grad[i : i + chunk]
            # d/dlogits = g * (onehot(target) - softmax), (chunk, V). Out of place first: without
            # index the chunk is a view of x, which must stay as it was.
            d = x[rows].float().sub(lse[i : i + chunk, None]).exp_().mul_(-g)
            grad_x[rows] = d.scatter_add_(-1, targets[i : i + chunk, None], g).to(x.dtype)
        return grad_x, None, None, None, None


def _head_backward(x, targets, weight, lse, grad, weight_grad: bool):
    """_TokenLogps' gradients through the output layer, block by block over the vocabulary rather
    than the rows: a block's (N, block) d/dlogits, recomputed from the saved log-sum-exp, times
    the N rows is that block of the weight's gradient, whole (summed over every row in one matmul),
    and is written straight into it in the weight's dtype. So the weight's gradient is the only
    (V, H) tensor made: no float32 (V, H) sum of per-chunk parts, no (V, H) part per chunk, no
    float32 copy to cast at the end. What sums across blocks is x's (N, H) gradient, in float32."""
    # Vocabulary rows per block: an (N, block) float32 chunk as large as a (rows, V) one.
    block = _chunk_rows(max(len(x), 1), x.device, matmul=True)
    grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    grad_weight = torch.empty_like(weight) if weight_grad else None
    for v in range(0, len(weight), block):
        w = weight[v : v + block]
        d = _product(x, w.T).float().sub_(lse[:, None]).exp_().mul_(-grad)
        # The one-hot's column in this block; rows whose target is in another block add 0.
        column = targets[:, None] - v
        inside = (column >= 0) & (column < len(w))
        d = d.scatter_add_(-1, column.clamp(0, len(w) - 1), grad * inside).to(x.dtype)
        grad_x += _product(d, w)
        if weight_grad:
            # Into the gradient itself: a product made first and copied in would be a second
            # (V, H) tensor when one block holds the whole vocabulary.
            torch.mm(d.T, x, out=grad_weight[v : v + block])
    return grad_x.to(x.dtype), None, None, grad_weight, None


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in a's dtype; from bf16 or fp16 on CUDA in float32, as cuBLAS accumulates it, not
    rounded to 8 bits of mantissa first (torch has no such CPU kernel)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


@dataclass
class _Scoring:
    """What ScoredHead.scoring asks of the output layer, and what it gives back."""

    index: torch.Tensor
    """(N,) flat (rows * T) positions, each one's hidden state predicting a scored token."""
    targets: torch.Tensor
    """(N,) the scored tokens."""
    squares: bool
    """Also each position's log sum_v p(v)^2 (WPO)."""
    logps: torch.Tensor | None = None
    """What the fused layer computed: (N,) float32 log-probs; with squares (2N,), the squares'
    after them."""


class ScoredHead(nn.Linear):
    """A causal LM's linear output layer that can score response tokens alone (see add_scored_head).
    Called as usual it returns logits (generation, Hugging Face's own loss). Inside scoring(), it
    projects only the N hidden states of its flattened (rows * T, H) input that predict scored
    tokens (no prompt or padding), fused into the chunked log-softmax: (N,) float32 log-probs, and
    no (N, V) logits at all. Unfused (on a CPU, see FUSED_HEAD_ON_CPU; or with a bias, or a config
    that reshapes logits after the layer, such as Gemma 2's soft-capping), it returns those N
    positions' (N, V) logits, which the model finishes as usual."""

    def __init__(self, head: nn.Linear, fusable: bool):
        super().__init__(
            head.in_features, head.out_features, bias=head.bias is not None, device="meta"
        )
        # The same parameters: ties and state-dict names are kept.
        self.weight = head.weight
        self.bias = head.bias
        self.fusable = fusable
        self._scoring = None

    @contextlib.contextmanager
    def scoring(self, index: torch.Tensor, targets: torch.Tensor, squares: bool = False):
        """Score the tokens `targets` (N,) predicted at flat positions `index` (N,), as in a
        ScoredRows, in the model's forwards inside; yields a record whose .logps the fused
        layer fills: (N,) float32 log-probs, and with `squares` (2N,), each position's log sum_v
        p(v)^2 after them. Unfused, .logps stays None and the model's logits are (N, V)."""
        self._scoring = _Scoring(index, targets, squares)
        try:
            yield self._scoring
        finally:
            self._scoring = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._scoring
        if request is None:
            return super().forward(hidden)
        scored = hidden.flatten(0, 1)[request.index]  # (N, H)
        fused = self.fusable and (FUSED_HEAD_ON_CPU or scored.device.type != "cpu")
        if not fused:
            return super().forward(scored)  # (N, V)
        request.logps = _TokenLogps.apply(
            scored, None, request.targets, self.weight, request.squares
        )
        return request.logps


@contextlib.contextmanager
def fused_head():
    """Inside, the output layer is fused into the loss on a CPU too, as on a GPU: for a memory plan
    of a GPU's step traced on the CPU."""
    global FUSED_HEAD_ON_CPU
    before = FUSED_HEAD_ON_CPU
    FUSED_HEAD_ON_CPU = True
    try:
        yield
    finally:
        FUSED_HEAD_ON_CPU = before


def add_scored_head(model: nn.Module) -> nn.Module:
    """Replace a Hugging Face causal LM's linear output layer by a ScoredHead in place, before
    sharding or adapters."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}'s output layer is a {type(head).__name__}, not a linear layer"
        )
    fusable = head.bias is None and not any(getattr(model.config, k, None) for k in _LOGIT_EXTRAS)
    model.set_output_embeddings(ScoredHead(head, fusable))
    return model


def response_logps(model, rows: ScoredRows, ld_alpha: float | None = None, weighting=False):
    """(R,) float32 summed log-probs of each of the R responses of `rows` (a ScoredRows, or any
    object with its fields), from a causal LM whose output layer is a ScoredHead. ld_alpha
    (LD-DPO): instead the (2P,) [chosen; rejected] sums of the rows' pairs, tokens past the pair's
    shorter response counting this much (_ld_sums). weighting=True (WPO) also returns (R,)
    log-weights, each response's mean over its tokens of log p(token) - log sum_v p(v)^2, with no
    gradient. With `rows.parts`, the second part's forward runs first, so that its activations are
    freed at once."""
    if rows.parts:
        scored, constant = rows.parts
        with torch.no_grad():
            tail = response_logps(model, constant)
        return torch.cat([response_logps(model, scored), tail])
    head = model.get_output_embeddings()
    if not isinstance(head, ScoredHead):
        raise ValueError(
            f"{type(head).__name__} is not a ScoredHead: call logps.add_scored_head(model) first"
        )
    shared = shared_row_inputs(model.config, rows.position_ids, rows.segment_ids, rows.document_ids)
    with head.scoring(rows.score_index, rows.score_targets, weighting) as scored:
        output = model(input_ids=rows.input_ids, use_cache=False, **shared)
    # Fused, the head scored the tokens itself; unfused, the model's logits are the (N, V) of the
    # scored positions, as the model made them.
    # (N,) log-probs; with weighting (2N,), the squares after them.
    values = scored.logps
    if values is None:
        values = _TokenLogps.apply(output.logits, None, rows.score_targets, None, weighting)
    n = len(rows.score_targets)
    lengths = rows.response_lengths
    token_logps = values[:n]
    if ld_alpha is None:
        sums = torch.segment_reduce(token_logps, "sum", lengths=lengths, unsafe=True, initial=0)
    else:
        sums = _ld_sums(token_logps, rows, ld_alpha)
    if not weighting:
        return sums
    # WPO: log p(token) - log sum_v p(v)^2, averaged over each response's tokens.
    aligned = (values[:n] - values[n:]).detach()
    log_weights = torch.segment_reduce(aligned, "sum", lengths=lengths, unsafe=True, initial=0)
    return sums, log_weights / lengths.clamp(min=1)


def response_rewards(model, rows: ScoredRows) -> torch.Tensor:
    """(R,) float32 rewards of the R responses of `rows` by a sequence-classification reward model
    with one label (reward_head): the head's output at each response's last token, the state
    that sees the prompt and the whole response, as the model's own forward reads it of a row
    holding the prompt and that response alone (at its last token that is not padding). No
    log-probs over the vocabulary."""
    kept = []
    handle = reward_head(model).register_forward_hook(
        lambda module, args, output: kept.append(output)
    )
    shared = shared_row_inputs(model.config, rows.position_ids, rows.segment_ids, rows.document_ids)
    try:
        model(input_ids=rows.input_ids, use_cache=False, **shared)
    finally:
        handle.remove()
    ends = rows.response_lengths.cumsum(0) - 1
    # A response's last token follows the state that predicts it, in the same row; where padding
    # is the EOS, transformers' classifier reads the token before it (the last that is not
    # padding), and so does this.
    last = rows.score_index[ends] + (rows.score_targets[ends] != model.config.pad_token_id)
    return kept[0].flatten(0, 1)[last, 0].float()  # (rows, T, 1) -> (R,)


def reward_head(model) -> nn.Module:
    """The scalar head of a Hugging Face sequence classifier (transformers names it score), inside
    any wrapper (peft's)."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "score":
            return module
    raise ValueError(f"{type(model).__name__} has no score head: it is not a sequence classifier")


def _ld_sums(token_logps: torch.Tensor, rows: ScoredRows, ld_alpha: float) -> torch.Tensor:
    """(2P,) [chosen; rejected] LD-DPO log-probs of the rows' pairs: each side summed over its
    first min(len chosen, len rejected) tokens, plus ld_alpha x the rest. A response in several
    pairs is summed once per pair, each with its own cut. On the device: no host sync."""
    lengths = rows.response_lengths
    starts = lengths.cumsum(0) - lengths
    side = torch.cat([rows.chosen_index, rows.rejected_index])  # (2P,)
    other = torch.cat([rows.rejected_index, rows.chosen_index])
    own = lengths[side]
    total = rows.pair_tokens
    # Each side's tokens laid end to end: `at` is a token's place within its response.
    ends = own.cumsum(0)
    at = torch.arange(total, device=own.device) - (ends - own).repeat_interleave(
        own, output_size=total
    )
    tokens = token_logps[starts[side].repeat_interleave(own, output_size=total) + at]  # (M,)
    cut = torch.minimum(own, lengths[other]).repeat_interleave(own, output_size=total)
    tokens = torch.where(at >= cut, ld_alpha * tokens, tokens)
    return torch.segment_reduce(tokens, "sum", lengths=own, unsafe=True, initial=0)


def shared_row_inputs(config, position_ids, segment_ids, document_ids=None) -> dict:
    """The model's position_ids and attention mask for shared rows of these (rows, T) positions
    and segments (ScoredRows'), and of packed rows' documents (None: not packed); {} for separate
    rows (position_ids None: causal, no mask). The mask
    as the model's transformers code (`config`) builds its own: one per kind of layer where the
    config has layer_types (narrowed to config.sliding_window on "sliding_attention" layers: Qwen2,
    Gemma 2 and 3), else one for every layer, narrowed to config.sliding_window where that is set
    (Mistral, Starcoder2)."""
    if position_ids is None:
        return {}
    window = getattr(config, "sliding_window", None)
    masks = {
        kind: _mask(
            config,
            segment_ids,
            position_ids,
            document_ids,
            window if kind == "sliding_attention" else None,
        )
        for kind in set(getattr(config, "layer_types", None) or ())
    }
    return {
        "position_ids": position_ids,
        "attention_mask": masks or _mask(config, segment_ids, position_ids, document_ids, window),
    }


def _mask(config, segments, positions, documents, window: int | None):
    """The attention mask of shared rows, in the form the model's attention takes: a token sees the
    earlier tokens of the prompt and of its own segment, of its own document where `documents`
    (packed rows) are given, and with a `window` only those fewer than `window` positions back.
    (B, 1, T, T) boolean for SDPA, additive float for eager; for FlexAttention a block mask, which
    skips the blocks masked whole."""
    rows, length = segments.shape

    def seen(b, h, q, k):
        visible = (k <= q) & ((segments[b, k] == 0) | (segments[b, k] == segments[b, q]))
        if documents is not None:
            visible = visible & (documents[b, k] == documents[b, q])
        if window:
            visible = visible & (positions[b, q] - positions[b, k] < window)
        return visible

    if config._attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(seen, rows, None, length, length, device=segments.device)
    at = torch.arange(length, device=segments.device)
    mask = seen(torch.arange(rows, device=at.device)[:, None, None], None, at[:, None], at)
    if config._attn_implementation == "eager":
        # Eager attention adds the mask to the scores.
        return torch.zeros(mask.shape, device=at.device).masked_fill_(~mask, -torch.inf)[:, None]
    return mask[:, None]  # (B, 1, T, T)
