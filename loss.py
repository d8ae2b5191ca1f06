"""Log-probabilities and the DPO loss family, computed in float32, and the loss of a batch of pairs.

Copyable on its own: imports only the standard library and torch.

    logps = sequence_logps(logits, labels)                  # (2B,) float32; labels -100 where not scored
    losses, chosen_rewards, rejected_rewards = preference_loss(*logps.chunk(2), *ref_logps.chunk(2), "dpo")
    out = forward_pairs(policy, reference, batch, LossConfig())   # a Hugging Face causal LM on (2B, T) pairs

References
- DPO: Rafailov et al. 2023, "Direct Preference Optimization", https://arxiv.org/abs/2305.18290 (Eq. 7).
- cDPO: Mitchell 2023, "A note on DPO with noisy preferences", https://ericmitchell.ai/cdpo.pdf
- IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
  https://arxiv.org/abs/2310.12036 (Eq. 17). Its log-ratios are sums as printed; TRL averages them per token
  (after checking with the authors), and so does --ipo-logps mean, the default here.
- Hinge (SLiC): Zhao et al. 2023, "SLiC-HF", https://arxiv.org/abs/2305.10425 (Eq. 2, with delta = 1).
- Robust DPO: Chowdhury et al. 2024, "Provably Robust DPO", https://arxiv.org/abs/2403.00409 (Eq. 8).
- SimPO: Meng et al. 2024, "SimPO", https://arxiv.org/abs/2405.14734 (Eq. 6).
- EXO: Ji et al. 2024, "Towards Efficient Exact Optimization of LM Alignment",
  https://arxiv.org/abs/2402.00856 (Eq. 16).
- NCA: Chen et al. 2024, "Noise Contrastive Alignment", https://arxiv.org/abs/2402.05369.
- BCO: Jung et al. 2024, "Binary Classifier Optimization", https://arxiv.org/abs/2404.04656.
- SPPO: Wu et al. 2024, "Self-Play Preference Optimization", https://arxiv.org/abs/2405.00675.
- APO: D'Oosterlinck et al. 2024, "Anchored Preference Optimization", https://arxiv.org/abs/2408.06266.
- DiscoPOP: Lu et al. 2024, "Discovering Preference Optimization Algorithms", https://arxiv.org/abs/2406.08414 (Eq. 5).
- AOT: Melnyk et al. 2024, "Distributional Preference Alignment via Optimal Transport",
  https://arxiv.org/abs/2406.05882.
- Length-normalised DPO: Lambert et al. 2024, "Tulu 3", https://arxiv.org/abs/2411.15124.
- RPO (DPO + NLL): Pang et al. 2024, "Iterative Reasoning Preference Optimization", https://arxiv.org/abs/2404.19733.
"""

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

LossType = Literal["dpo", "ipo", "hinge", "robust", "simpo", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                   "apo_zero", "apo_down", "discopop", "aot", "aot_pair", "dpo_norm", "sft"]
IGNORE_INDEX = -100

# The fused output layer (_HeadLogps) runs on GPUs, where memory is what runs out (4k-token pairs); on a CPU its
# recomputation in backward costs more than the memory it saves (a 60M model's median step: 3.39 s fused, 3.11 s
# not, 2-core CPU, fp32).
FUSED_HEAD_ON_CPU = False
_REFERENCE_FREE = {"simpo", "sft"}  # losses that never look at a reference model
_AVERAGED = {"simpo", "dpo_norm"}  # losses defined on length-averaged log-probs


@dataclass
class LossConfig:
    loss: LossType = "dpo"
    """dpo (cDPO when --label-smoothing > 0), one of the DPO family (see loss.py), or sft: the chosen responses'
    token-mean negative log-likelihood (no reference). simpo and sft are reference-free."""
    beta: float = 0.1
    """Inverse temperature: how far the policy may move from the reference (DPO's beta)."""
    label_smoothing: float = 0.0
    """Assumed share of flipped preference labels, in [0, 0.5): cDPO for dpo, the noise rate for robust."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma), used only with --loss simpo."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature of the mix between its logistic and exponential parts, only with --loss discopop."""
    sft_weight: float = 0.0
    """Add this times the chosen responses' token-mean NLL to the preference loss (RPO's alpha); 0 disables."""
    ipo_logps: Literal["mean", "sum"] = "mean"
    """IPO's log-probs: mean per token (TRL's, which it checked with the IPO authors), or sum (Eq. 17 as printed)."""

    def __post_init__(self):
        if self.loss not in get_args(LossType):
            raise ValueError(f"--loss {self.loss!r} is not one of {', '.join(get_args(LossType))}")
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_weight < 0 or (self.sft_weight and self.loss == "sft"):
            raise ValueError(f"--sft-weight must be >= 0 and goes with a preference --loss, got {self.sft_weight} "
                             f"with --loss {self.loss}")
        if not self.discopop_tau > 0:
            raise ValueError(f"--discopop-tau must be > 0, got {self.discopop_tau}")

    @property
    def reference_free(self) -> bool:
        """True when the loss needs no reference model."""
        return self.loss in _REFERENCE_FREE

    @property
    def pairwise(self) -> bool:
        """False for sft, which scores the chosen responses alone: no rejected log-probs, rewards or margins."""
        return self.loss != "sft"

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen responses' token-mean NLL in the loss: 1 for sft, else --sft-weight."""
        return 1.0 if self.loss == "sft" else self.sft_weight

    @property
    def average_logps(self) -> bool:
        """True when the loss takes per-token mean log-probs instead of sums."""
        return self.loss in _AVERAGED or (self.loss == "ipo" and self.ipo_logps == "mean")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Log-probability of each row's labelled tokens, in float32.

    logits: (B, T, V), any float dtype. labels: (B, T), aligned with the input ids as in Hugging Face: the
    token at position t is scored by the logits at t - 1 (the shift happens here); IGNORE_INDEX (-100) marks
    positions that do not count. Returns (B,) float32: sum_t log p(labels_t | <t), or the mean over counted
    tokens when average=True. A row with no counted tokens gives 0.

    No float32 copy of the logits is made: the log-softmax runs in float32 over chunks of counted
    positions only, and backward recomputes it chunk by chunk from the saved log-sum-exp (see _TokenLogps).
    """
    if logits.shape[:2] != labels.shape or logits.device != labels.device:
        raise ValueError(f"logits {tuple(logits.shape)} on {logits.device} and labels {tuple(labels.shape)} on "
                         f"{labels.device} must agree on (B, T) and device")
    mask = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): position t of the logits scores label t+1
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each: the counted positions
    token_logps = _TokenLogps.apply(logits, rows, cols, labels[:, 1:][mask])  # (N,) float32
    per_token = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    total = per_token.masked_scatter(mask, token_logps).sum(-1)  # (B,)
    return total / mask.sum(-1).clamp(min=1) if average else total


def _chunk_rows(vocab: int, device: torch.device, matmul: bool = False) -> int:
    # Rows per float32 (rows, V) chunk. A log-softmax alone on a CPU: 4 MiB stays in its caches. Chunks that also
    # run the output layer's matmuls, or any on a GPU: 256 MiB, as small matmuls are slow (on a 2-core CPU, a
    # 60M model's log-probs took 1.45x as long in 32-row chunks as in one), and at V = 128k, 523 rows still
    # fill a GPU.
    return max(1, (2**20 if device.type == "cpu" and not matmul else 2**26) // vocab)


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits[rows, cols])[targets] in float32, chunk by chunk.

    Forward keeps only the (N,) log-sum-exp besides its inputs; backward writes
    d/dlogits = grad * (onehot(target) - softmax) chunk by chunk into a gradient in the logits' dtype, so
    the extra memory is that gradient (which autograd needs anyway) plus one float32 chunk.
    """

    @staticmethod
    def forward(ctx, logits, rows, cols, targets):
        chunk = _chunk_rows(logits.shape[-1], logits.device)
        lse = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        for i in range(0, len(rows), chunk):
            x = logits[rows[i:i + chunk], cols[i:i + chunk]].float()  # (chunk, V)
            lse[i:i + chunk] = x.logsumexp(-1)
            picked[i:i + chunk] = x.gather(-1, targets[i:i + chunk, None]).squeeze(-1)
        ctx.save_for_backward(logits, rows, cols, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        logits, rows, cols, targets, lse = ctx.saved_tensors
        chunk = _chunk_rows(logits.shape[-1], logits.device)
        grad_logits = torch.zeros_like(logits)
        for i in range(0, len(rows), chunk):
            r, c, g = rows[i:i + chunk], cols[i:i + chunk], grad[i:i + chunk, None]
            x = (logits[r, c].float() - lse[i:i + chunk, None]).exp_().mul_(-g)  # -g * softmax
            x.scatter_add_(-1, targets[i:i + chunk, None], g)
            grad_logits[r, c] = x.to(logits.dtype)
        return grad_logits, None, None, None


class _HeadLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[targets] in float32 without ever holding the (N, V) logits: the output
    layer and the log-softmax run chunk by chunk. Forward keeps only the (N,) log-sum-exp; backward recomputes
    each chunk's logits and adds its share to the gradients of hidden and weight (accumulated in float32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):  # (N, H), (V, H), (N,)
        chunk = _chunk_rows(len(weight), hidden.device, matmul=True)
        lse = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        for i in range(0, len(hidden), chunk):
            x = (hidden[i:i + chunk] @ weight.T).float()  # (chunk, V)
            lse[i:i + chunk] = x.logsumexp(-1)
            picked[i:i + chunk] = x.gather(-1, targets[i:i + chunk, None]).squeeze(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk = _chunk_rows(len(weight), hidden.device, matmul=True)
        grad_hidden, grad_weight = torch.empty_like(hidden), None
        for i in range(0, len(hidden), chunk):
            h, g = hidden[i:i + chunk], grad[i:i + chunk, None]
            x = (h @ weight.T).float().sub_(lse[i:i + chunk, None]).exp_().mul_(-g)  # -g * softmax
            x = x.scatter_add_(-1, targets[i:i + chunk, None], g).to(hidden.dtype)  # d/dlogits, (chunk, V)
            grad_hidden[i:i + chunk] = x @ weight
            if ctx.needs_input_grad[1]:
                part = x.T @ h  # (V, H)
                grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    loss_type: LossType = LossConfig.loss,
    beta: float = LossConfig.beta,
    label_smoothing: float = LossConfig.label_smoothing,
    simpo_gamma: float = LossConfig.simpo_gamma,
    discopop_tau: float = LossConfig.discopop_tau,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and implicit rewards.

    All log-prob arguments are (B,) (summed, or averaged for simpo, dpo_norm and ipo by default). The reference
    ones may be None for a reference-free loss (simpo, sft), and are then taken as 0. With c = pi_c - ref_c,
    r = pi_r - ref_r, h = c - r, z = beta h, eps = label_smoothing and s = sigmoid:

        dpo       -(1 - eps) log s(z) - eps log s(-z)                      DPO Eq. 7; cDPO when eps > 0
        ipo       (h - 1 / (2 beta))^2                                     IPO Eq. 17 (on mean log-probs by default)
        hinge     max(0, 1 - z)                                            SLiC Eq. 2
        robust    (-(1 - eps) log s(z) + eps log s(-z)) / (1 - 2 eps)      rDPO Eq. 8
        simpo     -log s(beta (pi_c - pi_r) - simpo_gamma)                 SimPO Eq. 6, pi = mean log-probs
        exo_pair  s(z) (log s(z) - log(1 - e)) + s(-z) (log s(-z) - log e),  e = eps or 1e-3    EXO Eq. 16
        nca_pair  -log s(beta c) - log s(-beta c) / 2 - log s(-beta r) / 2                NCA
        bco_pair  -log s(beta c - d) - log s(-(beta r - d)), d = mean of beta c, beta r over the batch   BCO
        sppo_hard (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2                             SPPO
        apo_zero  (1 - s(beta c)) + s(beta r)                                             APO-zero
        apo_down  s(beta c) + (1 - s(z))                                                  APO-down
        discopop  (1 - m) (-log s(z)) + m exp(-z), m = s(z / discopop_tau)                DiscoPOP Eq. 5
                  (m exp(-z) as exp(log m - z): for z < -88.7, exp(-z) alone overflows float32, and 0 x inf is NaN)
        aot       dpo's formula on z = beta (sort(pi_c - pi_r) - sort(ref_c - ref_r))    AOT, sorted over the batch
        aot_pair  dpo's formula on z = beta (sort(c) - sort(r))                         AOT, sorted over the batch
        dpo_norm  dpo on mean log-probs                                                   Tulu 3
        sft       0: all of SFT's loss is chosen_nll, which the caller adds with weight 1

    bco_pair, aot and aot_pair compare pairs within the batch, so their value depends on how the batch is split
    into micro-batches (TRL's bco_pair keeps a running mean d across steps instead; here d is the batch's).

    Returns (losses, chosen_rewards, rejected_rewards), each (B,) float32, losses not reduced, rewards
    detached: beta * (policy - reference).
    """
    if ref_chosen_logps is None or ref_rejected_logps is None:
        if loss_type not in _REFERENCE_FREE:
            raise ValueError(f"loss {loss_type!r} needs reference log-probs")
        ref_chosen_logps = ref_rejected_logps = torch.zeros_like(policy_chosen_logps)
    pc, pr = policy_chosen_logps.float(), policy_rejected_logps.float()
    rc, rr = ref_chosen_logps.float(), ref_rejected_logps.float()
    h = (pc - rc) - (pr - rr)  # (B,)
    eps = label_smoothing
    c, r = pc - rc, pr - rr
    dpo = lambda z: -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type in ("dpo", "dpo_norm"):
        losses = dpo(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "simpo":
        losses = -F.logsigmoid(beta * (pc - pr) - simpo_gamma)
    elif loss_type == "exo_pair":
        e, z = eps or 1e-3, beta * h
        losses = z.sigmoid() * (F.logsigmoid(z) - math.log(1 - e)) + (-z).sigmoid() * (F.logsigmoid(-z) - math.log(e))
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    elif loss_type == "bco_pair":
        d = torch.cat([beta * c, beta * r]).mean().detach()
        losses = -F.logsigmoid(beta * c - d) - F.logsigmoid(-(beta * r - d))
    elif loss_type == "sppo_hard":
        losses = (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * c) + (1 - torch.sigmoid(beta * h))
    elif loss_type == "discopop":
        z = beta * h
        losses = torch.sigmoid(-z / discopop_tau) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / discopop_tau) - z)
    elif loss_type == "aot":
        losses = dpo(beta * ((pc - pr).sort().values - (rc - rr).sort().values))
    elif loss_type == "aot_pair":
        losses = dpo(beta * (c.sort().values - r.sort().values))
    elif loss_type == "sft":
        losses = torch.zeros_like(pc)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(get_args(LossType))}")
    return losses, beta * c.detach(), beta * r.detach()


def chosen_nll(chosen_logps: torch.Tensor, tokens_per_pair: float) -> torch.Tensor:
    """(B,) per-pair shares of the chosen responses' token-mean negative log-likelihood (SFT; RPO's added term).

    chosen_logps: (B,) summed log-probs. tokens_per_pair: the mean number of counted chosen tokens per pair
    over the whole batch (every rank and micro-batch). The mean over the batch's pairs of -chosen_logps /
    tokens_per_pair is -sum(log-probs) / sum(tokens): the token mean, however the batch is split.
    """
    return -chosen_logps.float() / tokens_per_pair


# ---------------------------------------------------------------------------------------------- a batch of pairs
def forward_pairs(policy, reference, batch: dict, objective: LossConfig, ref_logps: torch.Tensor | None = None,
                  tokens_per_pair: float | None = None) -> dict:
    """Per-pair losses, rewards and policy log-probs of Hugging Face causal LMs on a batch of B pairs: (2B, T)
    rows, [chosen; rejected], or the same sequences packed, as batches.collate_pairs makes them (input_ids,
    attention_mask, response_lengths, score_index, score_targets, score_rows, chosen_scored, chosen_rows, and
    position_ids and doc_ids when packed). ref_logps (2B,) summed, when given (--ref precompute), replaces
    running `reference`. tokens_per_pair: the whole batch's mean chosen tokens per pair, for the NLL of sft and
    --sft-weight (see chosen_nll). Also "tokens": the non-padding and all token slots the policy ran on."""
    if ref_logps is None and reference is not None:  # first, so its logits are freed before the policy's exist
        with torch.no_grad():
            ref_logps = model_logps(reference, batch)
    n = len(batch["response_lengths"]) // 2
    # SFT: only the chosen sequences, whose tokens, rows and scored positions come first.
    cut = {"response_lengths": n, **dict.fromkeys(("score_index", "score_targets", "score_rows"),
                                                   batch["chosen_scored"])}
    rows = batch if objective.pairwise else {key: v[:cut.get(key, batch["chosen_rows"])] if torch.is_tensor(v) else v
                                             for key, v in batch.items()}
    summed = model_logps(policy, rows)  # (2B,); SFT: (B,), as running the rejected rows would double the cost
    if not objective.pairwise:
        summed = torch.cat([summed, torch.zeros_like(summed)])  # rejected: not computed; no metric shows them
    per_token = batch["response_lengths"].clamp(min=1) if objective.average_logps else 1
    chosen, rejected = (summed / per_token).chunk(2)
    ref_chosen, ref_rejected = (ref_logps / per_token).chunk(2) if ref_logps is not None else (None, None)
    losses, chosen_rewards, rejected_rewards = preference_loss(
        chosen, rejected, ref_chosen, ref_rejected, loss_type=objective.loss, beta=objective.beta,
        label_smoothing=objective.label_smoothing, simpo_gamma=objective.simpo_gamma,
        discopop_tau=objective.discopop_tau)
    if objective.nll_weight:
        losses = losses + objective.nll_weight * chosen_nll(summed[:n], tokens_per_pair)
    mask = rows["attention_mask"]
    return {"losses": losses, "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
            "chosen_logps": chosen.detach(), "rejected_logps": rejected.detach(),
            "tokens": torch.stack([mask.sum(), torch.full((), mask.numel(), device=mask.device)]).float()}


def model_logps(model, batch: dict) -> torch.Tensor:
    """(rows,) float32 summed log-probs of a forward_pairs batch's responses, from a Hugging Face causal LM.

    Only the scored positions reach the output layer: hooks on it gather their hidden states (batch
    "score_index"), and for a plain bias-free linear head compute the log-probs chunk by chunk (_HeadLogps), so
    no (tokens, vocab) logits or gradient exist at all. A head with extras (bias, logit scaling or soft-capping)
    runs itself on the gathered states. Padded rows get no attention mask: the model's causal masking already
    keeps the padding after a row's tokens out of their view. Packed rows (batch "doc_ids") get a causal mask
    within each sequence and its own positions."""
    head, config, state = model.get_output_embeddings(), model.config, {}
    fused = (FUSED_HEAD_ON_CPU or head.weight.device.type != "cpu") and isinstance(head, torch.nn.Linear) and (
        head.bias is None and not any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale",
                                                                           "logits_scaling")))

    def gather(module, args):  # (rows, T, H) -> (1, N, H); fused: the head itself gets (1, 0, H)
        state["hidden"] = args[0].flatten(0, 1)[batch["score_index"]]
        return (state["hidden"][:0 if fused else None][None], *args[1:])

    def fuse(module, args, out):  # (1, N) token log-probs in place of the (1, 0, V) logits
        # Not a view: FSDP warns of a root output that is one, as an in-place op on it would skip its hooks.
        return _HeadLogps.apply(state["hidden"], module.weight, batch["score_targets"])[None].clone()
    hooks = [head.register_forward_pre_hook(gather)] + ([head.register_forward_hook(fuse)] if fused else [])
    try:
        packed = {"attention_mask": _document_mask(batch["doc_ids"], config._attn_implementation),
                  "position_ids": batch["position_ids"]} if "doc_ids" in batch else {}
        out = model(input_ids=batch["input_ids"], use_cache=False, **packed).logits[0]  # (N,) or (N, V)
    finally:
        for hook in hooks:
            hook.remove()
    if "hidden" not in state:
        raise ValueError(f"{type(model).__name__} does not call its output layer as a module; log-probs need it")
    if not fused:
        targets = batch["score_targets"]
        out = _TokenLogps.apply(out[None], torch.zeros_like(targets), torch.arange(len(targets), device=out.device),
                                targets)
    return torch.zeros(len(batch["response_lengths"]), device=out.device).index_add_(0, batch["score_rows"], out)


def _document_mask(doc_ids: torch.Tensor, attention: str) -> torch.Tensor:
    """(R, 1, T, T) attention mask of packed rows: each token sees its own sequence's earlier tokens only.
    Built on the device from (R, T) doc_ids, in the form the model's attention takes: boolean (True: attend) for
    sdpa, additive float for eager; the transformers masking code passes a 4D mask through untouched."""
    causal = torch.ones(doc_ids.shape[1], doc_ids.shape[1], dtype=torch.bool, device=doc_ids.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # (R, T, T)
    if attention == "sdpa":
        return mask[:, None]
    if attention == "eager":
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)[:, None]
    raise ValueError(f"--packing needs sdpa or eager attention, not {attention!r}")
