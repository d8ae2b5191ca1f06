"""Log-probabilities and the DPO loss family, computed in float32.

Copyable on its own: imports only the standard library and torch.

    logps = sequence_logps(logits, labels)  # (2B,) float32; labels -100 where not scored
    losses, chosen_rewards, rejected_rewards = preference_loss(
        *logps.chunk(2), *ref_logps.chunk(2), "dpo"
    )

A Hugging Face causal LM can skip the logits: give it a ScoredHead once, then score a
batches.RowBatch's responses (a prompt's K responses, each once, and the pairs they give):

    add_scored_head(model)  # before sharding; state-dict names unchanged
    logps = response_logps(model, batch)  # (R,) float32, one per response
    # both models' log-probs (the reference's first), then each pair's loss (or each row's,
    # for a listwise loss): {"losses", "chosen_rewards", ..., "logratios"}
    out = batch_loss(policy, reference, batch, LossConfig())

References
- DPO: Rafailov et al. 2023, https://arxiv.org/abs/2305.18290 (Eq. 7).
- cDPO: Mitchell 2023, https://ericmitchell.ai/cdpo.pdf
- IPO: Azar et al. 2023, https://arxiv.org/abs/2310.12036 (Eq. 17, on summed log-probs; see
  --ipo-logps).
- Hinge (SLiC): Zhao et al. 2023, https://arxiv.org/abs/2305.10425 (Eq. 2, with delta = 1).
- Robust DPO: Chowdhury et al. 2024, https://arxiv.org/abs/2403.00409 (Eq. 8).
- SimPO: Meng et al. 2024, https://arxiv.org/abs/2405.14734 (Eq. 6).
- EXO: Ji et al. 2024, https://arxiv.org/abs/2402.00856 (Eq. 16).
- NCA: Chen et al. 2024, https://arxiv.org/abs/2402.05369.
- BCO: Jung et al. 2024, https://arxiv.org/abs/2404.04656.
- SPPO: Wu et al. 2024, https://arxiv.org/abs/2405.00675.
- APO: D'Oosterlinck et al. 2024, https://arxiv.org/abs/2408.06266.
- DiscoPOP: Lu et al. 2024, https://arxiv.org/abs/2406.08414 (Eq. 5).
- AOT: Melnyk et al. 2024, https://arxiv.org/abs/2406.05882.
- Length-normalised DPO (Tulu 3): Lambert et al. 2024, https://arxiv.org/abs/2411.15124.
- RPO (DPO + NLL): Pang et al. 2024, https://arxiv.org/abs/2404.19733.
- MPO: https://arxiv.org/abs/2411.10442.
- f-DPO: Wang et al. 2023, https://arxiv.org/abs/2309.16240.
- WPO: Zhou et al. 2024, https://arxiv.org/abs/2406.11827.
- LD-DPO: Liu et al. 2024, https://arxiv.org/abs/2409.06411.
- TR-DPO: Gorbatovski et al. 2024, https://arxiv.org/abs/2404.09656 (fsdp_setup.mix_into).
- Plackett-Luce DPO: Rafailov et al. 2023, https://arxiv.org/abs/2305.18290 (App. A.3).
- InfoNCA, NCA (listwise): Chen et al. 2024, https://arxiv.org/abs/2402.05369 (Sec. 3 and 4).
- LiPO-lambda: Liu et al. 2024, https://arxiv.org/abs/2402.01878.
- KTO: Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306 (Eq. 7; TRL's KTOTrainer).
- ORPO: Hong et al. 2024, https://arxiv.org/abs/2403.07691 (Eq. 6-7; TRL's ORPOTrainer).
- CPO: Xu et al. 2024, https://arxiv.org/abs/2401.08417 (Eq. 3; TRL's CPOTrainer: --ref none).
- AlphaPO: Gupta et al. 2025, https://arxiv.org/abs/2501.03884.
"""

import contextlib
import copy
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

LossType = Literal[
    "dpo",
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "simpo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "aot",
    "aot_pair",
    "dpo_norm",
    "sft",
    "plackett_luce",
    "infonca",
    "nca",
    "lipo",
    "kto",
    "apo_zero_unpaired",
    "orpo",
]
IGNORE_INDEX = -100
# TRL's names for ours: resolved in LossConfig, so that checkpoints hold the canonical name.
_ALIASES = {"sigmoid": "dpo"}

# The fused output layer runs on GPUs, where memory is what runs out (long pairs); on a CPU its
# recomputation in backward costs more time than the memory it saves is worth (BENCHMARKS.md).
FUSED_HEAD_ON_CPU = False
# Losses that never look at a reference model.
_REFERENCE_FREE = {"simpo", "sft", "orpo"}
# Losses of a prompt's K responses at once (row_loss), not of its pairs.
_LISTWISE = {"plackett_luce", "infonca", "nca", "lipo"}
# Losses of each response alone, by its label (unpaired_loss), not of pairs.
_UNPAIRED = {"kto", "apo_zero_unpaired"}
# Losses defined on length-averaged log-probs.
_AVERAGED = {"simpo", "dpo_norm", "orpo"}
# The losses f-DPO has a form for.
_F_DIVERGENCE = {"dpo", "dpo_norm", "ipo", "hinge", "robust", "exo_pair", "discopop", "sft"}
# Model config fields that reshape the logits after the output layer: its result must stay logits.
_LOGIT_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# The attention implementations that take a shared prompt's mask: boolean for SDPA, additive for
# eager, a block mask for FlexAttention. Whether a model's attention takes that mask and the
# positions exactly is probed (shared_prompt_refusal): its transformers code, not a list of names.
_SHARED_PROMPT_ATTENTION = ("sdpa", "eager", "flex_attention")
# The probe's verdicts, once per process: by (model type, attention, config as JSON), "" where
# shared rows scored as separate ones, else why not (shared_prompt_refusal).
_PROBED: dict[tuple, str] = {}
# The probe's model: the model's own config with these fields made small where it sets them (not
# None or 0): 4 heads of the model's own width (so that rotary dims and rope scaling tables stay
# as they are; as many for keys and values, as latent attention needs), 16 small experts (groups
# of routed experts keep 2 each), windows (sliding, local, chunked) shorter than its rows, token
# ids dropped (the real ones lie outside the small vocabulary).
_PROBE_SIZES = {
    "vocab_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_kv_heads": 4,
    "intermediate_size": 32,
    "ffn_dim": 32,
    "n_inner": 32,
    "ffn_hidden_size": 32,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_local_experts": 16,
    "num_experts": 16,
    "n_routed_experts": 16,
    "moe_num_experts": 16,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "window_size": 4,
    "attention_chunk_size": 4,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


@dataclass
class LossConfig:
    loss: tuple[LossType, ...] = ()
    """dpo (when none is given; cDPO with --label-smoothing; sigmoid, TRL's name, is dpo), a
    DPO-family loss on pairs (see loss.py), or sft (chosen token-mean NLL). Repeat for a weighted
    sum (TRL's loss_type list; MPO: --loss dpo --loss bco_pair --loss sft). simpo, sft and orpo
    (ORPO: its odds-ratio term and its NLL of prompt and chosen response) are reference-free.
    plackett_luce, infonca, nca and lipo are listwise: each takes a prompt's whole row of K scored
    responses at once, not its pairs, and goes alone. kto and apo_zero_unpaired take each response
    alone by its label (thumbs up or down) and go alone too."""
    loss_weights: tuple[float, ...] = ()
    """One weight per --loss, in order (1 each when none is given): the loss is the weighted sum of
    each loss's batch mean. RPO is --loss dpo --loss sft --loss-weights 1 --loss-weights alpha."""
    beta: float = 0.1
    """Inverse temperature: how far the policy may move from the reference (DPO's beta)."""
    label_smoothing: float = 0.0
    """Assumed share of flipped preference labels, in [0, 0.5): cDPO for dpo, the noise rate for
    robust."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma), used only with --loss simpo."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature of the mix between its logistic and exponential parts, only with
    --loss discopop."""
    score_temperature: float = 1.0
    """infonca and nca's alpha: their targets are softmax(scores / alpha) over a prompt's
    responses."""
    ipo_logps: Literal["mean", "sum"] = "mean"
    """IPO's log-probs: mean per token (TRL's, which it checked with the IPO authors), or sum (Eq.
    17 as printed)."""
    use_weighting: bool = False
    """WPO (Zhou et al. 2024, Eq. 2): each pair's loss times its two responses' weights, exp of the
    policy's mean per token of log p(token) - log sum_v p(v)^2 (no gradient through them). Not with
    aot, aot_pair (they sort pairs)."""
    ld_alpha: float | None = None
    """LD-DPO (Liu et al. 2024), in [0, 1]: a response's log-prob is the sum over its first min(len
    chosen, len rejected) tokens plus this times the sum over the rest, for the policy and the
    reference alike. Default: none, plain sums."""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = (
        "reverse_kl"
    )
    """f-DPO (Wang et al. 2023): the summed log-ratios pass through f' before the loss; reverse_kl
    is DPO. Others only with dpo, dpo_norm, ipo, hinge, robust, exo_pair, discopop, sft (as TRL: the
    rest have no f-DPO form)."""
    f_alpha_divergence_coef: float = 0.5
    """alpha of alpha_divergence, f'(u) = (u^(alpha - 1) - 1) / (alpha - 1); alpha = 1 is
    reverse_kl."""
    desirable_weight: float = 1.0
    """KTO's weight on the losses of desirable (thumbs-up) responses."""
    undesirable_weight: float = 1.0
    """KTO's weight on the losses of undesirable (thumbs-down) responses."""
    cpo_alpha: float = 0.0
    """CPO's NLL weight (TRL's cpo_alpha): adds --loss sft at this weight, in place (--ref none
    --loss dpo --cpo-alpha 1 is TRL's CPOTrainer at its defaults). 0: none."""
    alphapo_alpha: float = 0.0
    """AlphaPO (Gupta et al. 2025) with --ref none: a response's reward is (1 - p^-alpha) / alpha
    of p = e^(its log-prob) instead of the log-prob (TRL CPOConfig's alpha). 0: the log-prob."""
    ref: Literal["online", "precompute", "none"] = "online"
    """online: a frozen reference runs every batch. precompute: one pass caches its log-probs (no
    second model). none: no reference, its log-probs taken as 0 (CPO: --loss dpo --ref none is
    CPO's sigmoid loss)."""
    sync_ref_model: bool = False
    """TR-DPO (Gorbatovski et al. 2024): every --ref-model-sync-steps optimizer steps the reference
    becomes alpha policy + (1 - alpha) reference, in its own dtype. Needs an online reference model
    (no LoRA)."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha, in [0, 1]: 1 copies the policy into the reference."""
    ref_model_sync_steps: int = 512
    """TR-DPO's period, in optimizer steps."""

    def __post_init__(self):
        # Resolved in place, so that every reader sees the list itself, by our names. A string,
        # from Python, is one loss; none given is dpo, and no weights given is 1 each.
        names = (self.loss,) if isinstance(self.loss, str) else self.loss
        self.loss = tuple(_ALIASES.get(name, name) for name in names) or ("dpo",)
        self.loss_weights = tuple(self.loss_weights) or (1.0,) * len(self.loss)
        if self.cpo_alpha:
            # Folded into the mix it is, so that a saved config holds it once.
            self.loss += ("sft",)
            self.loss_weights += (self.cpo_alpha,)
            self.cpo_alpha = 0.0
        for name in self.loss:
            if name not in get_args(LossType):
                raise ValueError(f"--loss {name!r} is not one of {', '.join(get_args(LossType))}")
        if len(self.loss_weights) != len(self.loss):
            raise ValueError(
                f"--loss-weights: {len(self.loss_weights)} weights for {len(self.loss)} --loss"
            )
        if not 0 < self.beta < math.inf:
            raise ValueError(f"--beta must be a finite number > 0, got {self.beta}")
        finite = (*self.loss_weights, self.simpo_gamma, self.f_alpha_divergence_coef)
        if not all(map(math.isfinite, (*finite, self.alphapo_alpha))):
            raise ValueError(
                "--loss-weights, --simpo-gamma, --f-alpha-divergence-coef and --alphapo-alpha must "
                f"be finite numbers, got {list(self.loss_weights)}, {self.simpo_gamma}, "
                f"{self.f_alpha_divergence_coef} and {self.alphapo_alpha}"
            )
        if not (0 <= self.desirable_weight < math.inf and 0 <= self.undesirable_weight < math.inf):
            raise ValueError(
                "--desirable-weight and --undesirable-weight must be finite numbers >= 0, got "
                f"{self.desirable_weight} and {self.undesirable_weight}"
            )
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not self.discopop_tau > 0:
            raise ValueError(f"--discopop-tau must be > 0, got {self.discopop_tau}")
        pair_options = (
            self.ld_alpha is not None,
            self.use_weighting,
            self.label_smoothing > 0,
            self.f_divergence_type != "reverse_kl",
        )
        alone = self.listwise or self.unpaired or "orpo" in self.loss
        if alone and (len(self.loss) > 1 or any(pair_options)):
            raise ValueError(
                f"--loss {' '.join(self.loss)}: a listwise loss (plackett_luce, infonca, nca, "
                "lipo), an unpaired one (kto, apo_zero_unpaired) or orpo goes alone, and without "
                "the options that act on pairs (--ld-alpha, --use-weighting, --label-smoothing, "
                "--f-divergence-type)"
            )
        if not self.score_temperature > 0:
            raise ValueError(f"--score-temperature must be > 0, got {self.score_temperature}")
        if (self.use_weighting or self.ld_alpha is not None) and not self.pairwise:
            raise ValueError(
                "--use-weighting and --ld-alpha weigh pairs: they need a preference --loss"
            )
        if self.ld_alpha is not None and not (
            0 <= self.ld_alpha <= 1 and not {"sft", "orpo"} & set(self.loss)
        ):
            raise ValueError(
                "--ld-alpha must be in [0, 1] and goes without --loss sft or orpo (whose NLL takes "
                f"plain log-probs), got {self.ld_alpha} with --loss {' '.join(self.loss)}"
            )
        if self.use_weighting and {"aot", "aot_pair"} & set(self.loss):
            raise ValueError(
                "--use-weighting: aot and aot_pair sort pairs across the batch, so weights would "
                "not meet their own pair's loss"
            )
        if self.f_divergence_type != "reverse_kl" and not set(self.loss) <= _F_DIVERGENCE:
            raise ValueError(
                f"--f-divergence-type {self.f_divergence_type} goes only with --loss "
                f"{', '.join(sorted(_F_DIVERGENCE))}, got {' '.join(self.loss)}"
            )
        if (self.alphapo_alpha and (alone or not self.reference_free)) or (
            self.ref == "none" and (alone or self.f_divergence_type != "reverse_kl")
        ):
            raise ValueError(
                "--alphapo-alpha goes only with a reference-free pairwise loss (--ref none, or "
                "simpo) but orpo; kto, apo_zero_unpaired, the listwise losses and "
                "--f-divergence-type need a reference, and orpo has none to drop"
            )
        if self.sync_ref_model and (self.ref == "precompute" or self.reference_free):
            raise ValueError(
                "--sync-ref-model updates a reference model: not with --ref precompute (fixed "
                "log-probs) or a reference-free --loss"
            )
        if not (0 <= self.ref_model_mixup_alpha <= 1 and self.ref_model_sync_steps >= 1):
            raise ValueError(
                "--ref-model-mixup-alpha must be in [0, 1] and --ref-model-sync-steps >= 1, got "
                f"{self.ref_model_mixup_alpha} and {self.ref_model_sync_steps}"
            )

    @property
    def reference_free(self) -> bool:
        return self.ref == "none" or set(self.loss) <= _REFERENCE_FREE

    @property
    def pairwise(self) -> bool:
        """False for sft alone, which scores the chosen responses only: no rejected log-probs,
        rewards or margins."""
        return self.loss != ("sft",)

    @property
    def listwise(self) -> bool:
        """True for a loss of all of a prompt's responses at once (row_loss): its unit is the row,
        not the pair."""
        return bool(set(self.loss) & _LISTWISE)

    @property
    def unpaired(self) -> bool:
        """True for a loss of each response alone by its label (unpaired_loss): its unit is the
        response."""
        return bool(set(self.loss) & _UNPAIRED)

    def averages(self, loss_type: str) -> bool:
        """True when `loss_type` takes per-token mean log-probs instead of sums."""
        return loss_type in _AVERAGED or (loss_type == "ipo" and self.ipo_logps == "mean")


def flag_defaults() -> LossConfig:
    """LossConfig's defaults as a command line (tyro) sees them: tyro appends each repeated --loss
    and --loss-weights to its default, so these two start empty here; LossConfig reads empty as
    dpo, with weight 1."""
    defaults = LossConfig()
    defaults.loss = ()
    defaults.loss_weights = ()
    return defaults


# ---------------------------------------------------------------------------------------- log-probs
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
        batches.RowBatch, in the model's forwards inside; yields a record whose .logps the fused
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


def response_logps(model, batch, ld_alpha: float | None = None, weighting: bool = False):
    """(R,) float32 summed log-probs of each of the R responses, from a causal LM whose output
    layer is a ScoredHead. batch: a batches.RowBatch, or anything with its input_ids (rows, T),
    score_index, score_targets (N,), response_lengths (R,) and position_ids (None for right-padded
    rows of one response each, which need no attention mask; else shared rows, given their mask:
    _shared_prompt). ld_alpha (LD-DPO): instead the (2P,) [chosen; rejected] sums of the batch's
    pairs (chosen_index, rejected_index, pair_tokens), tokens past the pair's shorter response
    counting this much (_ld_sums). weighting=True (WPO) also returns (R,) log-weights, each
    response's mean over its tokens of log p(token) - log sum_v p(v)^2, with no gradient."""
    head = model.get_output_embeddings()
    if not isinstance(head, ScoredHead):
        raise ValueError(
            f"{type(head).__name__} is not a ScoredHead: call loss.add_scored_head(model) first"
        )
    with head.scoring(batch.score_index, batch.score_targets, weighting) as scored:
        output = model(input_ids=batch.input_ids, use_cache=False, **_shared_prompt(model, batch))
    # Fused, the head scored the tokens itself; unfused, the model's logits are the (N, V) of the
    # scored positions, as the model made them.
    # (N,) log-probs; with weighting (2N,), the squares after them.
    values = scored.logps
    if values is None:
        values = _TokenLogps.apply(output.logits, None, batch.score_targets, None, weighting)
    n = len(batch.score_targets)
    lengths = batch.response_lengths
    token_logps = values[:n]
    if ld_alpha is None:
        sums = torch.segment_reduce(token_logps, "sum", lengths=lengths, unsafe=True, initial=0)
    else:
        sums = _ld_sums(token_logps, batch, ld_alpha)
    if not weighting:
        return sums
    # WPO: log p(token) - log sum_v p(v)^2, averaged over each response's tokens.
    aligned = (values[:n] - values[n:]).detach()
    log_weights = torch.segment_reduce(aligned, "sum", lengths=lengths, unsafe=True, initial=0)
    return sums, log_weights / lengths.clamp(min=1)


def batch_logps(model, batch, ld_alpha: float | None = None, weighting: bool = False):
    """response_logps of a batches.RowBatch; with KTO's mismatched completions (batch.parts), its
    scored responses' log-probs, then the mismatched ones', from a forward of their own without
    gradients (the KL estimate is a constant), run first so that its activations are freed at
    once. Policy and reference score them in the same rows, alike where their weights agree."""
    if not batch.parts:
        return response_logps(model, batch, ld_alpha, weighting)
    scored, mismatched = batch.parts
    with torch.no_grad():
        kl = response_logps(model, mismatched)
    return torch.cat([response_logps(model, scored), kl])


def _ld_sums(token_logps: torch.Tensor, batch, ld_alpha: float) -> torch.Tensor:
    """(2P,) [chosen; rejected] LD-DPO log-probs of the batch's pairs: each side summed over its
    first min(len chosen, len rejected) tokens, plus ld_alpha x the rest. A response in several
    pairs is summed once per pair, each with its own cut. On the device: no host sync."""
    lengths = batch.response_lengths
    starts = lengths.cumsum(0) - lengths
    side = torch.cat([batch.chosen_index, batch.rejected_index])  # (2P,)
    other = torch.cat([batch.rejected_index, batch.chosen_index])
    own = lengths[side]
    total = batch.pair_tokens
    # Each side's tokens laid end to end: `at` is a token's place within its response.
    ends = own.cumsum(0)
    at = torch.arange(total, device=own.device) - (ends - own).repeat_interleave(
        own, output_size=total
    )
    tokens = token_logps[starts[side].repeat_interleave(own, output_size=total) + at]  # (M,)
    cut = torch.minimum(own, lengths[other]).repeat_interleave(own, output_size=total)
    tokens = torch.where(at >= cut, ld_alpha * tokens, tokens)
    return torch.segment_reduce(tokens, "sum", lengths=own, unsafe=True, initial=0)


def shared_prompt_refusal(config) -> str:
    """Why a model of this config, in its attention implementation, does not score shared-prompt
    rows as it scores separate rows, in a line; "" where it does. Probed once per process for each
    model type, attention and config (_probe), on a copy of the config cut down, never on the
    model itself."""
    if config._attn_implementation not in _SHARED_PROMPT_ATTENTION:
        return f"{config._attn_implementation} attention takes no dense mask"
    if any(hasattr(value, "model_type") for value in vars(config).values()):
        # The probe would build the parts of other configs (a vision tower) at their full size.
        return f"{config.model_type} holds other models' configs: not probed"
    key = (config.model_type, config._attn_implementation, config.to_json_string(use_diff=False))
    if key not in _PROBED:
        _PROBED[key] = _probe(config)
    return _PROBED[key]


def _probe(config) -> str:
    """shared_prompt_refusal's verdict: a model of `config` cut down (_PROBE_SIZES; 2 layers, one
    at least of each kind in layer_types) with random float32 weights on the CPU, from seed 0 (the
    caller's random state kept; every rank agrees), scores a few pairs in shared and in separate
    rows, whose (2B,) log-probs must agree within 1e-5 of the largest; or the error of a model
    that refuses the mask or the positions (BLOOM's ALiBi, made from a 2D mask alone) or the cut."""
    threads = torch.get_num_threads()
    try:
        import transformers  # only here: the rest of this file needs torch alone

        # Tiny matrices: one thread is fastest, and spins on no other process's cores (seconds
        # instead of milliseconds on a busy host).
        torch.set_num_threads(1)
        small = copy.deepcopy(config)
        small.update({name: v for name, v in _PROBE_SIZES.items() if getattr(config, name, None)})
        # 4 heads of the model's own width: its head_dim, or hidden_size over heads.
        small.hidden_size = 4 * (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        if getattr(config, "layer_types", None):
            small.num_hidden_layers = max(2, len(set(config.layer_types)))
            # Each kind's first layer, then the model's first layers up to two in all.
            small.layer_types = [*dict.fromkeys(config.layer_types), *config.layer_types][
                : small.num_hidden_layers
            ]
        with torch.random.fork_rng(devices=()), torch.no_grad():
            torch.manual_seed(0)
            # FlexAttention compiles on a CPU (tens of seconds; some masks fail to): probed in
            # eager attention, which every model has, with the same mask (_mask) as a tensor.
            model = add_scored_head(
                transformers.AutoModelForCausalLM.from_config(
                    small,
                    attn_implementation=config._attn_implementation.replace(
                        "flex_attention", "eager"
                    ),
                    dtype=torch.float32,
                ).eval()
            )
            # (prompt, chosen, rejected) lengths: rows longer than the windows (4), responses of
            # unequal lengths both ways, a one-token prompt, padding in both layouts.
            pairs = [
                [torch.randint(1, 64, (n,), device="cpu") for n in lengths]
                for lengths in ((6, 4, 7), (1, 5, 2), (3, 2, 1))
            ]
            shared, separate = (response_logps(model, _probe_rows(pairs, s)) for s in (1, 0))
    except Exception as e:  # a model that cannot take the layout (or be cut down): separate rows
        return f"its probe raised {type(e).__name__}: " + str(e).strip().partition("\n")[0]
    finally:
        torch.set_num_threads(threads)
    gap = (shared - separate).abs().max().item()
    return (
        f"its probe's shared rows scored {gap:.2g} off separate rows"
        if gap > 1e-5 * separate.abs().max().item()
        else ""
    )


def _probe_rows(pairs: list, share: bool) -> SimpleNamespace:
    """batches.RowBatch's scoring fields as batches.collate_rows lays out pairs (that file is not
    imported: this one is copied alone) for pairs of (prompt, chosen, rejected) (n,) int64 tensors
    on the CPU: B shared rows [prompt | chosen | rejected], or 2B separate rows [prompt | chosen]
    then [prompt | rejected] (the other response left empty)."""
    rows = (
        pairs
        if share
        else [[p, c, r[:0]] for p, c, r in pairs] + [[p, c[:0], r] for p, c, r in pairs]
    )
    width = max(sum(map(len, row)) for row in rows)
    # Shared rows' positions, each response's starting where the prompt ends, and segments;
    # padding is segment -1, at position 0.
    positions = [
        torch.cat(
            [
                torch.arange(len(t), device="cpu") + min(s, 1) * len(row[0])
                for s, t in enumerate(row)
            ]
        )
        for row in rows
    ]
    segments = [torch.cat([torch.full_like(t, s) for s, t in enumerate(row)]) for row in rows]
    return SimpleNamespace(
        input_ids=pad_sequence([torch.cat(row) for row in rows], True),  # (rows, T)
        # Token j of response k (1 chosen, 2 rejected) in row r: predicted at flat position
        # r * width + prompt - 1 + j, past the chosen tokens too for the rejected ones but the first
        # (which the prompt's last position predicts).
        score_index=torch.tensor(
            [
                r * width + len(row[0]) - 1 + j + (j > 0) * (k - 1) * len(row[1])
                for k in (1, 2)
                for r, row in enumerate(rows)
                for j in range(len(row[k]))
            ],
            device="cpu",
        ),
        score_targets=torch.cat([pair[k] for k in (1, 2) for pair in pairs]),
        response_lengths=torch.tensor(
            [len(pair[k]) for k in (1, 2) for pair in pairs], device="cpu"
        ),
        # Separate rows are causal: given no positions and no mask.
        position_ids=pad_sequence(positions, True) if share else None,
        segment_ids=pad_sequence(segments, True, -1) if share else None,
    )


def _shared_prompt(model, batch) -> dict:
    """The position_ids and attention mask of a batches.RowBatch of shared rows; {} for separate
    rows (causal: no mask). The mask as the model's transformers code builds its own: one per kind
    of layer where the config has layer_types (narrowed to config.sliding_window on
    "sliding_attention" layers: Qwen2, Gemma 2 and 3), else one for every layer, narrowed to
    config.sliding_window where that is set (Mistral, Starcoder2)."""
    if batch.position_ids is None:
        return {}
    config = model.config
    window = getattr(config, "sliding_window", None)
    return {
        "position_ids": batch.position_ids,
        "attention_mask": {
            kind: _mask(config, batch, window if kind == "sliding_attention" else None)
            for kind in set(getattr(config, "layer_types", None) or ())
        }
        or _mask(config, batch, window),
    }


def _mask(config, batch, window: int | None):
    """The attention mask of shared rows, in the form the model's attention takes: a token sees the
    earlier tokens of the prompt and of its own segment, and with a `window` only those fewer than
    `window` positions back. (B, 1, T, T) boolean for SDPA, additive float for eager; for
    FlexAttention a block mask, which skips the blocks masked whole."""
    segments = batch.segment_ids
    positions = batch.position_ids
    rows, length = segments.shape

    def seen(b, h, q, k):
        visible = (k <= q) & ((segments[b, k] == 0) | (segments[b, k] == segments[b, q]))
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


def pair_logps(
    policy, reference, batch, objective: LossConfig, ref_logps: torch.Tensor | None = None
) -> dict:
    """The log-probs a batches.RowBatch's loss needs, under `objective`: "logps" (2P,) [chosen;
    rejected] of its pairs (summed; LD-DPO's with --ld-alpha) from the policy (sft alone: each row's
    best response then as many 0s, for B pairs); "ref_logps" the same of the reference, from
    `ref_logps` when given (precomputed: per response as response_logps gives them, per pair side
    with --ld-alpha), else the `reference` model (no gradient), else None (reference-free);
    "log_weights" (2P,) WPO's with --use-weighting, else None; "logratios" (R,) each response's
    policy - reference log-prob (None with --ld-alpha, whose log-probs are per pair, or with no
    reference); "responses" the policy's log-probs before they were laid out as pairs."""
    # The reference first, so that its activations are freed before the policy's exist.
    if ref_logps is None and reference is not None:
        with torch.no_grad():
            ref_logps = batch_logps(reference, batch, objective.ld_alpha)
    if not objective.pairwise:
        # SFT scores each row's best response alone (the batch holds no others).
        best = response_logps(policy, batch)
        return {
            "logps": torch.cat([best, torch.zeros_like(best)]),
            "ref_logps": None,
            "log_weights": None,
            "logratios": None,
        }
    log_weights = None
    logps = batch_logps(policy, batch, objective.ld_alpha, objective.use_weighting)
    if objective.use_weighting:
        logps, log_weights = logps
        log_weights = pair_sides(log_weights, batch)
    # ORPO's scored prompts come after the responses: each pair's, for its NLL.
    prompts = None
    if batch.scored_prompts:
        responses = len(batch.response_rows)
        prompts = logps[responses:][batch.response_rows[batch.chosen_index]]
        logps = logps[:responses]
        ref_logps = None if ref_logps is None else ref_logps[:responses]
    out = {
        "logps": logps,
        "ref_logps": ref_logps,
        "log_weights": log_weights,
        "logratios": None,
        "responses": logps,
        "prompt_logps": prompts,
    }
    if objective.ld_alpha is None:
        if ref_logps is not None:
            out["logratios"] = logps - ref_logps
            out["ref_logps"] = pair_sides(ref_logps, batch)
        out["logps"] = pair_sides(logps, batch)
    return out


def batch_loss(
    policy,
    reference,
    batch,
    objective: LossConfig,
    ref_logps: torch.Tensor | None = None,
    tokens_per_pair: float | None = None,
) -> dict[str, torch.Tensor]:
    """The objective on a batches.RowBatch: pair_logps, then pair_loss's (P,) tensors, whose
    "losses" a listwise objective replaces by row_loss's (B,), one per row, and an unpaired one by
    unpaired_loss's (R,), one per response; "units" (the row of each loss), "pair_rows" (the row
    of each pair's values) and pair_logps' "logratios" (R,). An unpaired loss gives its rewards
    and log-probs per response, NaN off their label ("chosen_*" on desirable responses), with its
    pairs' rewards (2P,) as "pair_rewards", and "kl". tokens_per_pair as in pair_loss."""
    scored = pair_logps(policy, reference, batch, objective, ref_logps)
    pair_rows = batch.response_rows[batch.chosen_index]
    if objective.unpaired:
        out = unpaired_loss(scored["logratios"], batch, objective)
        real = len(out["losses"])
        rewards = out["rewards"]
        logps = scored["responses"][:real].detach().float()
        good = batch.desirable
        return {
            "losses": out["losses"],
            "units": batch.response_rows[:real],
            "pair_rows": batch.response_rows[:real],
            "chosen_rewards": torch.where(good, rewards, math.nan),
            "rejected_rewards": torch.where(good, math.nan, rewards),
            "chosen_logps": torch.where(good, logps, math.nan),
            "rejected_logps": torch.where(good, math.nan, logps),
            "pair_rewards": pair_sides(rewards, batch).chunk(2),
            "kl": out["kl"],
            "logratios": None,
        }
    out = pair_loss(
        scored["logps"],
        scored["ref_logps"],
        pair_sides(batch.response_lengths, batch),
        objective,
        tokens_per_pair,
        scored["log_weights"],
        scored.get("prompt_logps"),
    )
    out["units"] = pair_rows
    out["pair_rows"] = pair_rows
    if objective.listwise or not objective.pairwise:
        out["units"] = torch.arange(len(batch.scores), device=pair_rows.device)
    if objective.listwise:
        out["losses"] = row_loss(scored["logratios"], batch, objective)
    if not objective.pairwise:
        # SFT alone: each row's best response stands for its one pair, against nothing.
        out["pair_rows"] = out["units"]
        out["rejected_rewards"] = None
    return {**out, "logratios": scored["logratios"]}


def unpaired_loss(logratios: torch.Tensor, batch, objective: LossConfig) -> dict:
    """KTO (Ethayarajh et al. 2024, Eq. 7, as TRL's KTOTrainer) or APO-zero-unpaired of a
    batches.RowBatch's labelled responses, from (R + M,) policy - reference log-probs of its R
    responses then its M mismatched ones (batch.mismatched; kto only). With h a response's
    log-ratio, s = sigmoid and z0 the KL estimate (the mismatched log-ratios' mean over this
    micro-batch, averaged over the ranks, clamped at 0, no gradient; 0 for apo_zero_unpaired),
    each response by its label (batch.desirable):

        desirable     desirable_weight x (1 - s(beta (h - z0)))
        undesirable   undesirable_weight x (1 - s(beta (z0 - h)))

    Returns (R,) "losses" and "rewards" (beta h, no gradient) and () "kl" (z0)."""
    real = len(logratios) - batch.mismatched
    h = logratios.float()
    kl = torch.zeros((), device=h.device)
    if batch.mismatched:
        kl = h[real:].detach().mean()
        if dist.is_initialized():
            # TRL's gather, then mean: each rank's micro-batch mean counts alike.
            dist.all_reduce(kl)
            kl = kl / dist.get_world_size()
        kl = kl.clamp(min=0)
    desirable = objective.desirable_weight * (1 - torch.sigmoid(objective.beta * (h[:real] - kl)))
    undesirable = objective.undesirable_weight * (
        1 - torch.sigmoid(objective.beta * (kl - h[:real]))
    )
    return {
        "losses": torch.where(batch.desirable, desirable, undesirable),
        "rewards": objective.beta * h[:real].detach(),
        "kl": kl,
    }


def kto_weight_advice(desirable: int, undesirable: int, objective: LossConfig) -> str:
    """TRL's advice where desirable and undesirable responses are unbalanced and neither
    --desirable-weight nor --undesirable-weight lies in the range that makes up for it (KTO paper,
    Eq. 8); "" where one does."""
    d = max(desirable, 1)
    u = max(undesirable, 1)
    wd = objective.desirable_weight
    wu = objective.undesirable_weight
    good = (round(u * wu / d, 2), round(u * wu / d * 1.33, 2))
    bad = (round(d * wd / u / 1.33, 2), round(d * wd / u, 2))
    if d == u or good[0] <= wd <= good[1] or bad[0] <= wu <= bad[1]:
        return ""
    return (
        f"{desirable} desirable and {undesirable} undesirable responses: TRL recommends "
        f"--desirable-weight in [{good[0]}, {good[1]}] or --undesirable-weight in [{bad[0]}, "
        f"{bad[1]}], not both"
    )


def pair_sides(values: torch.Tensor, batch) -> torch.Tensor:
    """(2P,) [chosen; rejected] of a batches.RowBatch's pairs from (R,) per-response values."""
    return values[torch.cat([batch.chosen_index, batch.rejected_index])]


# ------------------------------------------------------------------------------------------- losses
def pair_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    response_lengths: torch.Tensor,
    objective: LossConfig,
    tokens_per_pair: float | None = None,
    log_weights: torch.Tensor | None = None,
    prompt_logps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """(B,) float32 "losses", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps"
    under `objective` (its --loss-weights sum of losses; rewards and log-probs are its first
    preference loss's), from (2B,) [chosen; rejected] log-probs of the policy (sft alone: rejected
    ones 0, not computed) and the reference (None for a reference-free loss); see preference_loss
    for f-DPO. response_lengths: (2B,) tokens per response, for losses on mean log-probs.
    tokens_per_pair: the batch's mean chosen tokens per pair, for sft's NLL. log_weights: (2B,)
    WPO's (pair_logps), or None; each pair's loss is scaled by exp(its chosen + rejected).
    prompt_logps: (B,) each pair's prompt's summed log-probs (its tokens but the first), for
    orpo's NLL, which counts them beside the chosen response's (tokens_per_pair then counts
    them too)."""
    scores = logps
    ref_scores = ref_logps
    if objective.f_divergence_type != "reverse_kl" and ref_logps is not None:
        # f-DPO: f' of the summed log-ratios takes the log-ratios' place.
        scores = _f_prime(
            logps - ref_logps, objective.f_divergence_type, objective.f_alpha_divergence_coef
        )
        ref_scores = torch.zeros_like(scores)
    # The loss whose rewards and log-probs are logged: the first preference loss.
    shown = next((name for name in objective.loss if name != "sft"), "sft")
    losses = 0.0
    out = {}
    for loss_type, weight in zip(objective.loss, objective.loss_weights):
        per_token = response_lengths.clamp(min=1) if objective.averages(loss_type) else 1
        refs = (None, None) if ref_scores is None else (ref_scores / per_token).chunk(2)
        rewards = scores / per_token
        if objective.alphapo_alpha:
            # AlphaPO: (1 - p^-alpha) / alpha of p = e^(log-prob), written so that a summed
            # log-prob's tiny p does not overflow p^-alpha.
            alpha = objective.alphapo_alpha
            rewards = (1 - torch.exp(-alpha * rewards)) / alpha
        # A listwise loss's pairs log dpo's rewards; its losses are row_loss's, per row.
        part, chosen_rewards, rejected_rewards = preference_loss(
            *rewards.chunk(2),
            *refs,
            loss_type="dpo" if loss_type in _LISTWISE else loss_type,
            beta=objective.beta,
            label_smoothing=objective.label_smoothing,
            simpo_gamma=objective.simpo_gamma,
            discopop_tau=objective.discopop_tau,
        )
        if loss_type == "sft":
            part = chosen_nll(logps[: len(part)], tokens_per_pair)
        if loss_type == "orpo":
            part = part + chosen_nll(logps[: len(part)] + prompt_logps, tokens_per_pair)
        losses = losses + weight * part
        if loss_type == shown and not out:
            chosen, rejected = (logps / per_token).detach().chunk(2)
            out = {
                "chosen_rewards": chosen_rewards,
                "rejected_rewards": rejected_rewards,
                "chosen_logps": chosen,
                "rejected_logps": rejected,
            }
    if log_weights is not None:
        # WPO: each pair's loss times w_chosen * w_rejected.
        losses = losses * log_weights.view(2, -1).sum(0).exp()  # (2B,) -> (2, B) -> (B,)
    return {"losses": losses, **out}


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    loss_type: LossType = "dpo",
    beta: float = LossConfig.beta,
    label_smoothing: float = LossConfig.label_smoothing,
    simpo_gamma: float = LossConfig.simpo_gamma,
    discopop_tau: float = LossConfig.discopop_tau,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses (not reduced) and implicit rewards (detached: beta * (policy -
    reference)), each (B,) float32. The log-probs are (B,), summed or averaged (simpo, dpo_norm, and
    ipo by default); the reference ones may be None, taken as 0 (reference-free: simpo, sft, or
    any loss with --ref none, as CPO's sigmoid, hinge and ipo are dpo, hinge and ipo). With c =
    pi_c - ref_c, r = pi_r - ref_r, h = c - r, z = beta h, eps = label_smoothing and s = sigmoid:

        dpo        -(1 - eps) log s(z) - eps log s(-z)                DPO Eq. 7; cDPO when eps > 0
                   (sigmoid, TRL's name for it, is the same)
        ipo        (h - 1 / (2 beta))^2                               IPO Eq. 17 (mean log-probs
                                                                      by default)
        hinge      max(0, 1 - z)                                      SLiC Eq. 2
        robust     (-(1 - eps) log s(z) + eps log s(-z)) / (1 - 2 eps)   rDPO Eq. 8
        simpo      dpo's formula on z = beta (pi_c - pi_r) - simpo_gamma   SimPO Eq. 6, mean
                                                                      log-probs (CPO's simpo)
        exo_pair   s(z) (log s(z) - log(1 - e)) + s(-z) (log s(-z) - log e),
                   e = eps or 1e-3                                    EXO Eq. 16
        nca_pair   -log s(beta c) - log s(-beta c) / 2 - log s(-beta r) / 2   NCA
        bco_pair   -log s(beta c - d) - log s(-(beta r - d)),
                   d = the batch mean of beta c and beta r            BCO
        sppo_hard  (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2        SPPO
        apo_zero   (1 - s(beta c)) + s(beta r)                        APO-zero
        apo_down   s(beta c) + (1 - s(z))                             APO-down
        discopop   (1 - m) (-log s(z)) + m exp(-z), m = s(z / discopop_tau)   DiscoPOP Eq. 5
                   (m exp(-z) as exp(log m - z): for z < -88.7, exp(-z) alone overflows
                   float32, and 0 x inf is NaN)
        aot        dpo's formula on z = beta (sort(pi_c - pi_r) - sort(ref_c - ref_r)),
                   sorted over the batch                              AOT
        aot_pair   dpo's formula on z = beta (sort(c) - sort(r)), sorted over the batch   AOT
        dpo_norm   dpo on mean log-probs                              Tulu 3
        orpo       -beta log s(log odds(pi_c) - log odds(pi_r)), log odds(x) = x - log(1 - e^x),
                   on mean log-probs; pair_loss adds its NLL          ORPO Eq. 6-7
        sft        0: all of SFT's loss is chosen_nll, which pair_loss puts in its place

    Around these, in pair_loss and response_logps (TRL's names):

        loss list      sum_i loss_weights_i x (batch mean of loss_i)         MPO; RPO: dpo + sft
        f_divergence   c, r -> f'(e^c), f'(e^r) on summed log-ratios, averaged after;
                       rewards beta f'                                       f-DPO
                       forward_kl 1 - e^-c, js_divergence log 2 + log s(c),
                       alpha_divergence (e^((a-1)c) - 1) / (a-1)
        use_weighting  each pair's loss x w_c w_r,
                       log w = mean_t log p(y_t) - log sum_v p(v)^2 (policy, no grad)   WPO
        ld_alpha       log pi(y) = sum over its first min(|y_c|, |y_r|) tokens
                       + ld_alpha x the rest (policy and reference)          LD-DPO
        alpha (CPO)    pi -> (1 - e^(-alpha pi)) / alpha, reference-free     AlphaPO

    bco_pair, aot and aot_pair compare pairs within the batch, so their value depends on how the
    batch is split into micro-batches."""
    if ref_chosen_logps is None or ref_rejected_logps is None:
        ref_chosen_logps = ref_rejected_logps = torch.zeros_like(policy_chosen_logps)
    pc = policy_chosen_logps.float()
    pr = policy_rejected_logps.float()
    rc = ref_chosen_logps.float()
    rr = ref_rejected_logps.float()
    c = pc - rc
    r = pr - rr
    h = c - r
    z = beta * h
    eps = label_smoothing
    if loss_type in ("dpo", "sigmoid", "dpo_norm"):
        losses = _dpo(z, eps)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - z)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    elif loss_type == "simpo":
        losses = _dpo(beta * (pc - pr) - simpo_gamma, eps)
    elif loss_type == "exo_pair":
        e = eps or 1e-3  # EXO's epsilon: 1e-3 unless --label-smoothing gives one
        losses = z.sigmoid() * (F.logsigmoid(z) - math.log(1 - e)) + (-z).sigmoid() * (
            F.logsigmoid(-z) - math.log(e)
        )
    elif loss_type == "nca_pair":
        losses = (
            -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
        )
    elif loss_type == "bco_pair":
        d = torch.cat([beta * c, beta * r]).mean().detach()
        losses = -F.logsigmoid(beta * c - d) - F.logsigmoid(-(beta * r - d))
    elif loss_type == "sppo_hard":
        losses = (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * c) + (1 - torch.sigmoid(z))
    elif loss_type == "discopop":
        losses = torch.sigmoid(-z / discopop_tau) * -F.logsigmoid(z) + torch.exp(
            F.logsigmoid(z / discopop_tau) - z
        )
    elif loss_type == "aot":
        losses = _dpo(beta * ((pc - pr).sort().values - (rc - rr).sort().values), eps)
    elif loss_type == "aot_pair":
        losses = _dpo(beta * (c.sort().values - r.sort().values), eps)
    elif loss_type == "orpo":
        # The log odds log(p / (1 - p)) of the mean per-token probability p.
        losses = -beta * F.logsigmoid((pc - _log1mexp(pc)) - (pr - _log1mexp(pr)))
    elif loss_type == "sft":
        losses = torch.zeros_like(pc)
    else:
        raise ValueError(
            f"unknown loss_type {loss_type!r}; choose one of {', '.join(get_args(LossType))}"
        )
    return losses, beta * c.detach(), beta * r.detach()


def row_loss(logratios: torch.Tensor, batch, objective: LossConfig) -> torch.Tensor:
    """(B,) float32 listwise losses (listwise_loss) of a batches.RowBatch's rows from (R,)
    per-response policy - reference log-probs (pair_logps' "logratios")."""
    rows, most = batch.scores.shape
    flat = torch.zeros(rows * most, device=logratios.device).index_put(
        (batch.response_rows * most + batch.response_columns,), logratios.float()
    )
    return listwise_loss(
        flat.view(rows, most),  # (B, K)
        batch.scores,
        ~batch.scores.isnan(),
        objective.loss[0],
        objective.beta,
        objective.score_temperature,
    )


def listwise_loss(
    logratios: torch.Tensor,
    scores: torch.Tensor,
    valid: torch.Tensor,
    loss_type: str = "plackett_luce",
    beta: float = LossConfig.beta,
    alpha: float = LossConfig.score_temperature,
) -> torch.Tensor:
    """(B,) float32 per-prompt losses (not reduced) of B prompts with up to K responses each.
    logratios: (B, K) log pi(y_i|x) - log pi_ref(y_i|x), summed over each response's tokens, any
    float dtype; scores: (B, K) the data's scores, higher is better; valid: (B, K) bool, False on
    padding. A row's K_row valid entries may sit anywhere in it; padding may hold anything (NaN,
    inf): it changes neither value nor gradient, and a row without a valid entry has loss 0. With
    r_i = beta logratio_i, w = softmax(score / alpha) over the row's valid entries, s = sigmoid,
    and sums over valid i, j:

        plackett_luce  -sum_i [r_i - log(e^r_i + sum_{j: score_j < score_i} e^r_j)]   DPO App. A.3
                       (the Plackett-Luce NLL of the ranking by score: response tau(k) chosen
                       among tau(k..K); ties below)
        infonca        -sum_i w_i log softmax(r)_i                             InfoNCA, NCA Sec. 3
        nca            -sum_i [w_i log s(r_i) + log s(-r_i) / K_row]           NCA Sec. 4
        lipo           -sum_{i, j: score_i > score_j} D_ij log s(r_i - r_j)    LiPO-lambda
                       D_ij = |G_i - G_j| |1 / log2(1 + t_i) - 1 / log2(1 + t_j)|, G = 2^score - 1,
                       t_i = rank of r_i among the row's (1 = highest; ties by position), D_ij
                       without gradient (LambdaLoss's weights: the rank is a step function)

    Ties in score, plackett_luce: a response is chosen from among itself and those scored strictly
    below it, so tied responses are never ordered against each other (as DPO has no pair for a
    tie). The loss then does not depend on where tied responses sit in the row, and pushes their
    rewards neither apart nor together; a row of all-tied scores has loss 0. With distinct scores
    it is A.3's loss exactly: at K = 2, dpo's. infonca and nca at K = 2 with w = (1, 0) (alpha -> 0,
    or scores far apart) are dpo and nca_pair. lipo's gains need 2^score finite (graded scores,
    < 128)."""
    # Padding zeroed here: its NaN or inf reaches no value, and it gets a gradient of 0.
    r = torch.where(valid, beta * logratios.float(), 0)
    scores = torch.where(valid, scores.float(), 0)
    better = valid[:, :, None] & valid[:, None, :] & (_gaps(scores) > 0)  # (B, K, K): i beats j
    if loss_type == "plackett_luce":
        # A pairwise mask, not a cumulative log-sum-exp over sorted rewards: it leaves out a
        # response's ties wherever they sit, K is a handful, and no sort or -inf prefix is needed.
        choice = better | torch.eye(r.shape[-1], dtype=torch.bool, device=r.device)  # (B, K, K)
        log_denominators = r[:, None, :].masked_fill(~choice, -math.inf).logsumexp(-1)  # (B, K)
        return -torch.where(valid, r - log_denominators, 0).sum(-1)
    targets = (scores / alpha).masked_fill(~valid, -math.inf).softmax(-1)
    if loss_type == "infonca":
        log_probs = r.masked_fill(~valid, -math.inf).log_softmax(-1)
        # Padding's 0 x -inf is NaN: where, not a product, drops it.
        return -torch.where(valid, targets * log_probs, 0).sum(-1)
    if loss_type == "nca":
        # K_row; 1 in a row without responses, whose loss is 0 anyway: no 0 / 0 in backward.
        k_row = valid.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        per_response = targets * F.logsigmoid(r) + F.logsigmoid(-r) / k_row
        return -torch.where(valid, per_response, 0).sum(-1)
    if loss_type == "lipo":
        # Each response's 0-based position when the row's valid rewards are sorted, highest first.
        key = torch.where(valid, r.detach(), -math.inf)
        positions = key.argsort(dim=-1, descending=True, stable=True).argsort(-1)
        discounts = 1 / torch.log2(positions.float() + 2)
        gains = torch.exp2(scores)  # the gains' -1 cancels in |G_i - G_j|
        weights = torch.where(better, _gaps(gains).abs() * _gaps(discounts).abs(), 0)
        return -(weights * F.logsigmoid(_gaps(r))).sum((1, 2))
    raise ValueError(
        f"unknown listwise loss_type {loss_type!r}; choose one of plackett_luce, infonca, nca, lipo"
    )


def _gaps(x: torch.Tensor) -> torch.Tensor:
    """(B, K, K) x_i - x_j of a (B, K) x."""
    return x[:, :, None] - x[:, None, :]


def chosen_nll(chosen_logps: torch.Tensor, tokens_per_pair: float) -> torch.Tensor:
    """(B,) per-pair shares of the chosen responses' token-mean NLL (SFT; RPO's added term), from
    summed log-probs. tokens_per_pair: mean chosen tokens per pair over all ranks and micro-batches:
    pairs average to the token mean."""
    return -chosen_logps.float() / tokens_per_pair


def _f_prime(log_ratio: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """f-DPO's f'(u) at u = pi / pi_ref, from log u, as TRL computes it: forward_kl 1 - 1 / u,
    js_divergence log(2u / (1 + u)), alpha_divergence (u^(alpha - 1) - 1) / (alpha - 1) with the
    exponential kept finite, reverse_kl log u (without f-DPO's + 1)."""
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if kind == "alpha_divergence" and abs(alpha - 1) >= 1e-6:
        return (torch.exp(((alpha - 1) * log_ratio).clamp(max=80)) - 1) * (1 / (alpha - 1))
    return log_ratio


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0, each way where it keeps its digits (as TRL's ORPO)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _dpo(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
