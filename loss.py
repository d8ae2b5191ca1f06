"""The DPO loss family, computed in float32: a table of formulas, then the functions that compute
them on log-probs. Copyable on its own: imports only the standard library and torch.

With c = pi_c - ref_c, r = pi_r - ref_r (a pair's summed log-probs, or their means per token where
the loss says so), h = c - r, z = beta h, eps = label_smoothing and s = sigmoid, each pair's loss:

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
               on mean log-probs; pair_losses adds its NLL        ORPO Eq. 6-7
    sft        the chosen responses' token-mean NLL (chosen_nll)      SFT; RPO: dpo + sft
    bradley_terry  -log s(r_c - r_r - margin), r a reward model's scores, not log-probs
               (reward_losses)                                    Bradley-Terry; TRL's RewardTrainer

Around these, in pair_losses (and LD-DPO's and WPO's log-probs, logps.py) (TRL's names):

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

bco_pair, aot and aot_pair compare pairs within the batch, so their value depends on how the batch
is split into micro-batches. Listwise losses take a prompt's K scored responses at once
(listwise_loss: plackett_luce, infonca, nca, lipo); unpaired ones each response alone by its label
(response_losses: kto, apo_zero_unpaired).

The functions, one entry point per kind of loss, each returning Losses:

    pair_losses(objective, logps, ref_logps, lengths)   # (2P,) [chosen; rejected] -> (P,) losses
    row_losses(objective, logratios, scores, logps, ref_logps)   # (B, K) rows -> (B,) losses
    response_losses(objective, logratios, logps, desirable, kl, chosen, rejected)   # -> (R,)
    reward_losses(rewards, margins, center)   # a reward model's (2P,) rewards -> (P,) losses

and the formulas they apply: preference_loss (the pairs' table above), listwise_loss, chosen_nll.

This runs as written:

    import torch
    from loss import LossConfig, pair_losses, preference_loss

    # (P,) summed log-probs of each pair's sides, by the policy and by the reference.
    chosen = torch.tensor([-10.0, -12.0], device="cpu")
    rejected = torch.tensor([-11.0, -11.5], device="cpu")
    ref_chosen = torch.tensor([-10.5, -12.0], device="cpu")
    ref_rejected = torch.tensor([-11.0, -11.0], device="cpu")
    losses, chosen_rewards, rejected_rewards = preference_loss(
        chosen, rejected, ref_chosen, ref_rejected, "dpo", beta=0.1
    )
    out = pair_losses(
        LossConfig(loss=("dpo", "sft"), loss_weights=(1.0, 0.5)),
        torch.cat([chosen, rejected]),  # (2P,) policy log-probs
        torch.cat([ref_chosen, ref_rejected]),
        torch.tensor([5, 6, 4, 7], device="cpu"),  # (2P,) response lengths
        tokens_per_pair=5.5,
    )
    print(out.losses, out.chosen_rewards)

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

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
import torch.nn.functional as F

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
    "bradley_terry",
]
# TRL's names for ours: resolved in LossConfig, so that checkpoints hold the canonical name.
_ALIASES = {"sigmoid": "dpo"}
# Losses that never look at a reference model.
_REFERENCE_FREE = {"simpo", "sft", "orpo", "bradley_terry"}
# Losses of a prompt's K responses at once (row_losses), not of its pairs.
_LISTWISE = {"plackett_luce", "infonca", "nca", "lipo"}
# Losses of each response alone, by its label (response_losses), not of pairs.
_UNPAIRED = {"kto", "apo_zero_unpaired"}
# Losses defined on length-averaged log-probs.
_AVERAGED = {"simpo", "dpo_norm", "orpo"}
# The losses f-DPO has a form for.
_F_DIVERGENCE = {"dpo", "dpo_norm", "ipo", "hinge", "robust", "exo_pair", "discopop", "sft"}
# Pair losses (by our names), which mix (a weighted sum) and take the options that act on pairs;
# the others go alone.
_MIXABLE = (
    set(get_args(LossType)) - _LISTWISE - _UNPAIRED - {"orpo", "bradley_terry"} - set(_ALIASES)
)
# What a reward model's loss (bradley_terry) takes: the options of log-prob losses are refused.
_REWARD_OPTIONS = {"loss", "loss_weights", "center_rewards_coefficient"}

# The options' compatibility, checked by LossConfig: each option, when set away from its default,
# goes only with these losses (or says why) and needs this of the run.
_PAIRS = "a preference --loss (not sft alone)"
_GOES_WITH = {
    "center_rewards_coefficient": ({"bradley_terry"}, _PAIRS, "it centers a reward model's scores"),
    "ld_alpha": (_MIXABLE - {"sft"}, _PAIRS, "sft's and orpo's NLL take plain log-probs"),
    "use_weighting": (
        _MIXABLE - {"aot", "aot_pair"},
        _PAIRS,
        "WPO weighs pairs; aot and aot_pair sort pairs across the batch, so weights would not "
        "meet their own pair",
    ),
    "label_smoothing": (_MIXABLE, _PAIRS, "it acts on pairs"),
    "f_divergence_type": (_F_DIVERGENCE, "a reference", "the others have no f-DPO form, as in TRL"),
    "alphapo_alpha": (
        _MIXABLE,
        "no reference (--ref none, or simpo)",
        "AlphaPO shapes reference-free rewards",
    ),
    "sync_ref_model": (
        _MIXABLE | _LISTWISE | _UNPAIRED,
        "a reference model (--ref online)",
        "TR-DPO updates it",
    ),
}
# Each number's range, [lowest, highest], and how an error says it; every one must be finite.
_BELOW = math.nextafter
_RANGES = {
    "loss_weights": (-math.inf, math.inf, "a finite number"),
    "beta": (_BELOW(0, 1), math.inf, "a finite number > 0"),
    "label_smoothing": (0, _BELOW(0.5, 0), "in [0, 0.5)"),
    "simpo_gamma": (-math.inf, math.inf, "a finite number"),
    "discopop_tau": (_BELOW(0, 1), math.inf, "a finite number > 0"),
    "score_temperature": (_BELOW(0, 1), math.inf, "a finite number > 0"),
    "ld_alpha": (0, 1, "in [0, 1]"),
    "f_alpha_divergence_coef": (-math.inf, math.inf, "a finite number"),
    "desirable_weight": (0, math.inf, "a finite number >= 0"),
    "undesirable_weight": (0, math.inf, "a finite number >= 0"),
    "alphapo_alpha": (-math.inf, math.inf, "a finite number"),
    "center_rewards_coefficient": (0, math.inf, "a finite number >= 0"),
    "ref_model_mixup_alpha": (0, 1, "in [0, 1]"),
    "ref_model_sync_steps": (1, math.inf, ">= 1"),
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
    alone by its label (thumbs up or down) and go alone too. bradley_terry trains a reward model
    (a scalar head on the model, scoring each response at its last token) on the pairs, alone."""
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
    center_rewards_coefficient: float = 0.0
    """bradley_terry only: c of TRL's centering term, c x mean((r_chosen + r_rejected)^2), which
    keeps a reward model's scores near 0 (Eisenstein et al. 2023). 0: none."""

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
        for name, (low, high, said) in _RANGES.items():
            # A number, a tuple of them (--loss-weights), or None (--ld-alpha: none).
            given = getattr(self, name)
            for value in given if isinstance(given, tuple) else (given,):
                if value is not None and not (math.isfinite(value) and low <= value <= high):
                    raise ValueError(f"--{name.replace('_', '-')} must be {said}, got {value}")
        losses = " ".join(self.loss)
        defaults = {f.name: f.default for f in fields(self)}
        if "bradley_terry" in self.loss:
            # The options of losses on log-probs; a reward model has none.
            flags = [
                "--" + k.replace("_", "-")
                for k, v in defaults.items()
                if getattr(self, k) != v and k not in _REWARD_OPTIONS
            ]
            flags += [f"--loss {name}" for name in self.loss if name != "bradley_terry"]
            if flags:
                raise ValueError(
                    f"--loss bradley_terry trains a reward model, which computes no log-probs: "
                    f"{flags[0]} does not go with it"
                )
        if len(self.loss) > 1 and set(self.loss) - _MIXABLE:
            raise ValueError(
                f"--loss {losses}: a listwise loss (plackett_luce, infonca, nca, lipo), an "
                "unpaired one (kto, apo_zero_unpaired) or orpo goes alone"
            )
        if self.ref == "none" and set(self.loss) - _MIXABLE:
            raise ValueError(
                f"--ref none: --loss {losses} does not take it (a listwise or unpaired loss needs "
                "a reference; orpo has none to drop)"
            )
        has = {
            _PAIRS: self.pairwise,
            "a reference": not self.reference_free,
            "no reference (--ref none, or simpo)": self.reference_free,
            "a reference model (--ref online)": self.ref == "online" and not self.reference_free,
        }
        for name, (losses_ok, needs, why) in _GOES_WITH.items():
            flag = "--" + name.replace("_", "-")
            if getattr(self, name) == defaults[name]:
                continue
            if not set(self.loss) <= losses_ok:
                raise ValueError(
                    f"{flag} goes only with --loss {', '.join(sorted(losses_ok))} ({why}), got "
                    f"--loss {losses}"
                )
            if not has[needs]:
                raise ValueError(f"{flag} needs {needs}: got --loss {losses} --ref {self.ref}")

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
        """True for a loss of all of a prompt's responses at once (row_losses): its unit is the row,
        not the pair."""
        return bool(set(self.loss) & _LISTWISE)

    @property
    def unpaired(self) -> bool:
        """True for a loss of each response alone by its label (response_losses): its unit is the
        response."""
        return bool(set(self.loss) & _UNPAIRED)

    @property
    def reward_model(self) -> bool:
        """True for bradley_terry: a reward model trains, scoring responses (reward_losses)."""
        return self.loss == ("bradley_terry",)

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


def kto_weight_advice(labels: list[bool], objective: LossConfig) -> str:
    """TRL's advice where desirable (True) and undesirable `labels` are unbalanced and neither
    --desirable-weight nor --undesirable-weight lies in the range that makes up for it (KTO paper,
    Eq. 8); "" where one does."""
    desirable = sum(labels)
    undesirable = len(labels) - desirable
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


# ------------------------------------------------------------------------------------------- losses
@dataclass
class Losses:
    """What each entry point returns for a micro-batch: the losses, not reduced, and what is logged
    of them. Every field has one shape whatever the loss; all but `losses` carry no gradient."""

    losses: torch.Tensor
    """(U,) float32: one loss per unit, which `unit` names."""
    unit: Literal["pair", "row", "response"]
    """What a loss is of: a pair (pair_losses; for sft alone a row's best response), a prompt's
    row of K responses (row_losses) or one response (response_losses)."""
    chosen_rewards: torch.Tensor
    """(P,) float32: each pair's preferred response's reward (the first preference loss's)."""
    rejected_rewards: torch.Tensor | None
    """(P,) float32: the other response's; None for sft alone, which has no pairs."""
    chosen_logps: torch.Tensor
    """(P,) float32: the policy's log-probs of the preferred responses (per token for a loss on
    means)."""
    rejected_logps: torch.Tensor | None
    """(P,) float32: the other responses'; None for sft alone."""
    response_rewards: torch.Tensor | None = None
    """(R,) float32: each response's reward, for an unpaired loss (logged by label); else None."""
    response_logps: torch.Tensor | None = None
    """(R,) float32: each response's log-prob, for an unpaired loss; else None."""
    kl: torch.Tensor | None = None
    """() float32: KTO's reference point z0 (0 for apo_zero_unpaired); None for other losses."""
    logratios: torch.Tensor | None = None
    """(R,) float32: each response's policy - reference log-prob, where the caller has them (for
    ranking metrics); else None."""


def pair_losses(
    objective: LossConfig,
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    lengths: torch.Tensor,
    tokens_per_pair: float | None = None,
    log_weights: torch.Tensor | None = None,
    prompt_logps: torch.Tensor | None = None,
) -> Losses:
    """(P,) losses of P pairs under `objective` (its --loss-weights sum of pair losses; rewards and
    log-probs are its first preference loss's), from (2P,) [chosen; rejected] summed log-probs of
    the policy (sft alone: each row's best response, then P zeros) and the reference (None:
    reference-free). lengths: (2P,) tokens per response, for losses on means. tokens_per_pair: the
    step's mean chosen tokens per pair, for sft's NLL. log_weights: (2P,) WPO's, or None; each
    pair's loss is scaled by exp(its chosen + rejected). prompt_logps: (P,) each pair's prompt's
    summed log-probs (its tokens but the first), for orpo's NLL, which counts them beside the
    chosen response's."""
    scores = logps
    ref_scores = ref_logps
    if objective.f_divergence_type != "reverse_kl" and ref_logps is not None:
        # f-DPO: f' of the summed log-ratios takes the log-ratios' place.
        scores = _f_prime(
            logps - ref_logps, objective.f_divergence_type, objective.f_alpha_divergence_coef
        )
        ref_scores = torch.zeros_like(scores)
    pairs = len(logps) // 2
    losses = 0.0
    for loss_type, weight in zip(objective.loss, objective.loss_weights):
        if loss_type == "sft":
            part = chosen_nll(logps[:pairs], tokens_per_pair)
        else:
            policy, reference = _pair_inputs(objective, loss_type, scores, ref_scores, lengths)
            part, _, _ = preference_loss(
                *policy.chunk(2),
                *((None, None) if reference is None else reference.chunk(2)),
                loss_type=loss_type,
                beta=objective.beta,
                label_smoothing=objective.label_smoothing,
                simpo_gamma=objective.simpo_gamma,
                discopop_tau=objective.discopop_tau,
            )
        if loss_type == "orpo":
            part = part + chosen_nll(logps[:pairs] + prompt_logps, tokens_per_pair)
        losses = losses + weight * part
    if log_weights is not None:
        # WPO: each pair's loss times w_chosen * w_rejected.
        losses = losses * log_weights.view(2, -1).sum(0).exp()  # (2P,) -> (2, P) -> (P,)
    # The loss whose rewards and log-probs are logged: the first preference loss.
    shown = next((name for name in objective.loss if name != "sft"), "sft")
    policy, reference = _pair_inputs(objective, shown, scores, ref_scores, lengths)
    chosen_rewards, rejected_rewards = _rewards(objective.beta, policy, reference).chunk(2)
    chosen_logps, rejected_logps = (logps / _per_token(objective, shown, lengths)).detach().chunk(2)
    if not objective.pairwise:
        rejected_rewards = rejected_logps = None
    return Losses(losses, "pair", chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)


def row_losses(
    objective: LossConfig,
    logratios: torch.Tensor,
    scores: torch.Tensor,
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
) -> Losses:
    """(B,) listwise losses (listwise_loss, objective.loss[0]) of B prompts' rows from (B, K)
    summed policy - reference log-probs of their responses and (B, K) scores (NaN past a row's own
    K); the rewards and log-probs logged are dpo's of the pairs the rows give, from (2P,) [chosen;
    rejected] summed log-probs of the policy and the reference."""
    losses = listwise_loss(
        logratios,
        scores,
        ~scores.isnan(),
        objective.loss[0],
        objective.beta,
        objective.score_temperature,
    )
    chosen_rewards, rejected_rewards = _rewards(objective.beta, logps, ref_logps).chunk(2)
    chosen_logps, rejected_logps = logps.detach().float().chunk(2)
    return Losses(losses, "row", chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)


def response_losses(
    objective: LossConfig,
    logratios: torch.Tensor,
    logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    chosen_index: torch.Tensor,
    rejected_index: torch.Tensor,
) -> Losses:
    """KTO (Ethayarajh et al. 2024, Eq. 7, as TRL's KTOTrainer) or APO-zero-unpaired of R labelled
    responses, from their (R,) policy - reference log-probs h, (R,) policy log-probs and (R,) bool
    labels (True: desirable). kl: () the reference point z0 (KTO's estimate, which the caller makes
    from mismatched completions, over the ranks, clamped at 0, without gradient; 0 for
    apo_zero_unpaired). With s = sigmoid, each response by its label:

        desirable     desirable_weight x (1 - s(beta (h - z0)))
        undesirable   undesirable_weight x (1 - s(beta (z0 - h)))

    The rewards (beta h) are logged by label, and over the (P,) pairs of a prompt's desirable and
    undesirable responses (chosen_index, rejected_index: indices into the R) for accuracy and
    margin."""
    h = logratios.float()
    beta = objective.beta
    good = objective.desirable_weight * (1 - torch.sigmoid(beta * (h - kl)))
    bad = objective.undesirable_weight * (1 - torch.sigmoid(beta * (kl - h)))
    rewards = beta * h.detach()
    logps = logps.detach().float()
    return Losses(
        torch.where(desirable, good, bad),
        "response",
        rewards[chosen_index],
        rewards[rejected_index],
        logps[chosen_index],
        logps[rejected_index],
        response_rewards=rewards,
        response_logps=logps,
        kl=kl,
    )


def reward_losses(rewards: torch.Tensor, margins: torch.Tensor, center: float = 0.0) -> Losses:
    """(P,) Bradley-Terry losses of a reward model (TRL's RewardTrainer) from its (2P,) [chosen;
    rejected] rewards r_c, r_r and (P,) margins m (0 where the data gives none):

        -log s(r_c - r_r - m) + center x (r_c + r_r)^2

    The rewards are logged as a DPO loss's are; a reward model has no log-probs (NaN, not
    logged)."""
    chosen, rejected = rewards.float().chunk(2)
    losses = -F.logsigmoid(chosen - rejected - margins) + center * (chosen + rejected) ** 2
    absent = torch.full_like(chosen, math.nan)
    return Losses(losses, "pair", chosen.detach(), rejected.detach(), absent, absent)


def _per_token(objective: LossConfig, loss_type: str, lengths: torch.Tensor):
    """What a loss divides its log-probs by: the responses' lengths for a loss on means, else 1."""
    return lengths.clamp(min=1) if objective.averages(loss_type) else 1


def _pair_inputs(objective: LossConfig, loss_type: str, scores, ref_scores, lengths) -> tuple:
    """(policy, reference) (2P,) as `loss_type` takes them: per token where it averages, AlphaPO's
    reward shape on the policy's; reference None where there is none."""
    per_token = _per_token(objective, loss_type, lengths)
    policy = scores / per_token
    if objective.alphapo_alpha:
        # AlphaPO: (1 - p^-alpha) / alpha of p = e^(log-prob), written so that a summed log-prob's
        # tiny p does not overflow p^-alpha.
        alpha = objective.alphapo_alpha
        policy = (1 - torch.exp(-alpha * policy)) / alpha
    if ref_scores is None:
        return policy, None
    return policy, ref_scores / per_token


def _rewards(beta: float, policy: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """(2P,) float32 implicit rewards beta (policy - reference), None as 0; no gradient."""
    if reference is None:
        return beta * policy.float().detach()
    return beta * (policy.float() - reference.float()).detach()


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
    """Per-pair preference losses (not reduced), the module docstring's table, and implicit rewards
    (detached: beta * (policy - reference)), each (B,) float32. The log-probs are (B,), summed or
    averaged (simpo, dpo_norm, and ipo by default); the reference ones may be None, taken as 0
    (reference-free: simpo, or any loss with --ref none, as CPO's sigmoid, hinge and ipo are dpo,
    hinge and ipo). sft's loss is chosen_nll, not this: its row here is 0."""
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
    # simpo, aot and aot_pair are dpo's formula on a margin of their own.
    if loss_type == "simpo":
        z = beta * (pc - pr) - simpo_gamma
    elif loss_type == "aot":
        z = beta * ((pc - pr).sort().values - (rc - rr).sort().values)
    elif loss_type == "aot_pair":
        z = beta * (c.sort().values - r.sort().values)
    if loss_type in ("dpo", "sigmoid", "dpo_norm", "simpo", "aot", "aot_pair"):
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - z)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
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
