"""Policy objectives, chosen by name: ALP, the baselines of the paper's appendix table, and the
training-inference corrections in wide use (CISPO, IcePop).

Every loss but CISPO is the PPO/GRPO clipped surrogate ``max(-A r, -A clip(r, 1 - eps_low, 1 +
eps_high))`` (dual-clipped at ``-A c`` for negative advantages) on ONE importance ratio ``r``; the
losses differ only in which ratio they use, at which level, and in an optional detached per-token
weight. CISPO (MiniMax-M1, eq. 4) declares ``objective="is_weighted"``: the REINFORCE term
``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta``, which clips the weight rather than
dropping the token, so tokens outside the clip range still get gradient.

Each loss is one function registered with :func:`register_policy_loss`, which declares
everything about it: the ratio and correction it implements (for the docs table), its level,
whether the policy-update forward is perturbed (ALP), whether it reads the old training policy,
and its default clip range (the paper: 0.2/0.28 for token ratios, 0.5/3.0 for sequence ratios).
Config resolution (:mod:`megatron_alp.resolve`), the trainer, the docs table (``megatron-alp
config-docs``) and the benchmarks read :data:`POLICY_LOSSES`; nothing else lists the names.

A sequence-level ratio is ``exp(sum_t log r_t)`` (``seq_ratio: product``) or its geometric mean
``exp(mean_t log r_t)``; it enters the clipped term on every token of its sequence, which is then
aggregated like a token loss. Masked importance sampling (Token-/Seq-MIS) multiplies the
objective of sequence ``i`` by the correcting ratio ``rho'_i = prod_t pi_old / pi_rollout`` and
masks it where ``rho'_i > C`` (paper section 2 and its appendix table: the correction is at
sequence level for both); ``mis_two_sided`` also masks ``rho'_i < 1/C``. Masked tokens stay in the
normaliser, as in the paper's ``1/n sum_i sum_t Mask * ...``. Log-ratios are clamped to
``+-log_ratio_clamp`` before ``exp`` so that no ratio overflows.

Normalisation: ``global_tokens``/``global_seqs`` count the whole mini-batch (all micro-batches,
all data-parallel ranks), so the micro-batch losses returned here sum to the mini-batch loss.
Both count loss tokens only (:func:`loss_counts`): a sequence without any (an empty response, an
episode of void turns, a truncated response under ``loss.mask_truncated``) is out of the loss as
if it were not in the batch, and a mini-batch without loss tokens has loss 0, never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from megatron_alp.config import LossConfig

Tensor = torch.Tensor


@dataclass
class LossInputs:
    """One micro-batch of per-token quantities, all ``[B, T]`` aligned on the target token."""

    logprobs: Tensor  # current training forward (perturbed for ALP), requires grad
    rollout_logprobs: Tensor  # reported by the rollout engine
    advantages: Tensor  # [B], one per sequence
    mask: Tensor  # 1 (or True) where the token is in the loss
    old_logprobs: Optional[Tensor] = None  # unperturbed training policy before this iteration's updates
    ref_logprobs: Optional[Tensor] = None  # reference policy (KL penalty)
    entropy: Optional[Tensor] = None  # entropy of the current training forward (bonus)
    global_tokens: Optional[float] = None  # loss tokens in the mini-batch; None: this micro-batch's
    global_seqs: Optional[float] = None  # sequences in the mini-batch; None: this micro-batch's


@dataclass
class Ratio:
    """What a registered loss contributes: its log importance ratio and optional token weight."""

    log_ratio: Tensor  # [B, T] token level or [B] sequence level, differentiable, 0 where masked
    weight: Optional[Tensor] = None  # [B, T] detached factor on the per-token loss
    masked: Optional[Tensor] = None  # [B, T] bool: loss tokens removed by a mask (mask/frac)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered objective and what it declares about itself."""

    name: str
    ratio_fn: Callable[["LossConfig", LossInputs, Tensor], Ratio]
    paper: str  # the name in the paper's tables
    level: Literal["token", "seq"]  # level of the clipped ratio
    perturbed: bool  # the policy-update forward is perturbed (ALP)
    needs_old: bool  # reads LossInputs.old_logprobs (the trainer runs the old-policy pass)
    clip: tuple[float, float]  # default (clip_low, clip_high)
    ratio: str  # the clipped ratio, for the docs table
    correction: str = "—"  # the detached correction, for the docs table
    objective: Literal["clipped", "is_weighted"] = "clipped"  # PPO's surrogate, or CISPO's weighted REINFORCE
    knobs: tuple[str, ...] = ()  # the keys of the loss section this loss alone (or with a few) reads

    def clip_range(self, cfg: "LossConfig") -> tuple[float, float]:
        """``(clip_low, clip_high)``: the config's values, or this loss's defaults where unset."""
        low = self.clip[0] if cfg.clip_low is None else cfg.clip_low
        high = self.clip[1] if cfg.clip_high is None else cfg.clip_high
        return low, high


POLICY_LOSSES: dict[str, PolicyLoss] = {}

TOKEN_CLIP = (0.2, 0.28)
SEQ_CLIP = (0.5, 3.0)


def register_policy_loss(
    name: str,
    *,
    paper: str,
    level: Literal["token", "seq"],
    ratio: str,
    perturbed: bool = False,
    needs_old: bool = False,
    clip: Optional[tuple[float, float]] = None,
    correction: str = "—",
    objective: Literal["clipped", "is_weighted"] = "clipped",
    knobs: tuple[str, ...] = (),
):
    """Register ``fn(cfg, inputs, mask) -> Ratio`` as policy loss ``name`` with its properties
    (``clip`` defaults to the paper's range for ``level``; ``objective``: see the module docstring;
    ``knobs``: the ``loss.*`` keys of its own, declared in config/sections/loss.py under a
    ``# read by:`` comment naming it). Registering is all it takes for a new loss to be selectable
    as ``loss.name``."""
    if level not in ("token", "seq"):
        raise ValueError(f"policy loss {name!r}: level must be 'token' or 'seq' (got {level!r})")
    if objective not in ("clipped", "is_weighted"):
        raise ValueError(f"policy loss {name!r}: objective must be 'clipped' or 'is_weighted' (got {objective!r})")

    def register(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(
            name=name, ratio_fn=fn, paper=paper, level=level, perturbed=perturbed, needs_old=needs_old,
            clip=clip or (TOKEN_CLIP if level == "token" else SEQ_CLIP), ratio=ratio, correction=correction,
            objective=objective, knobs=tuple(knobs),
        )
        return fn

    return register


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def needs_old_logprobs(name: str) -> bool:
    return get_policy_loss(name).needs_old


def needs_ref_logprobs(cfg: "LossConfig") -> bool:
    return cfg.kl_coef > 0


def losses_table() -> str:
    """Markdown table of the registered losses (the docs' table is generated from it)."""
    rows = ["| `loss.name` | paper | clipped ratio | level | correction | perturbed | default clip | own keys |",
            "|---|---|---|---|---|---|---|---|"]
    for p in POLICY_LOSSES.values():
        own = ", ".join(f"`loss.{k}`" for k in p.knobs) or "—"
        rows.append(f"| `{p.name}` | {p.paper} | `{p.ratio}` | {p.level} | {p.correction} | "
                    f"{'yes' if p.perturbed else 'no'} | {p.clip[0]} / {p.clip[1]} | {own} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- ratios


def _wide(x: Tensor) -> Tensor:
    """At least fp32 (bf16/fp16 logprobs are upcast; fp64 stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def token_log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """``log num - log den`` on loss tokens, exactly 0 elsewhere (padding may hold anything)."""
    return torch.where(mask, _wide(num) - _wide(den), 0.0)


def seq_log_ratio(token_lr: Tensor, mask: Tensor, how: str) -> Tensor:
    """Sequence log-ratio ``[B]``: sum of token log-ratios, or their mean for ``geometric_mean``."""
    total = token_lr.sum(-1)
    if how == "product":
        return total
    if how == "geometric_mean":
        return total / mask.sum(-1).clamp(min=1)
    raise ValueError(f"loss.seq_ratio: expected 'product' or 'geometric_mean', got {how!r}")


def _mis_weight(cfg: "LossConfig", inputs: LossInputs, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token weight ``rho'_i * 1{rho'_i <= C}`` (and ``>= 1/C`` when two-sided) with
    ``rho'_i = prod_t pi_old / pi_rollout``, and the bool map of the tokens it masks."""
    log_rho = seq_log_ratio(token_log_ratio(inputs.old_logprobs, inputs.rollout_logprobs, mask), mask, "product")
    log_c = math.log(cfg.mis_threshold)
    keep = log_rho <= log_c
    if cfg.mis_two_sided:
        keep &= log_rho >= -log_c
    weight = torch.where(keep, log_rho.clamp(max=log_c).exp(), 0.0).detach()
    return weight.unsqueeze(-1).expand_as(mask), ~keep.unsqueeze(-1) & mask


def _seq_vs_rollout(cfg, inputs, mask):
    return seq_log_ratio(token_log_ratio(inputs.logprobs, inputs.rollout_logprobs, mask), mask, cfg.seq_ratio)


@register_policy_loss("alp_token", paper="Token-ALP", level="token", perturbed=True,
                      ratio="pi_theta,sigma / pi_rollout")
def _alp_token(cfg, inputs, mask):
    return Ratio(token_log_ratio(inputs.logprobs, inputs.rollout_logprobs, mask))


@register_policy_loss("alp_seq", paper="Seq-ALP", level="seq", perturbed=True,
                      ratio="pi_theta,sigma / pi_rollout (seq_ratio)", knobs=("seq_ratio",))
def _alp_seq(cfg, inputs, mask):
    return Ratio(_seq_vs_rollout(cfg, inputs, mask))


@register_policy_loss("grpo", paper="GRPO", level="token", needs_old=True, ratio="pi_theta / pi_old")
def _grpo(cfg, inputs, mask):
    return Ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask))


@register_policy_loss("gspo", paper="GSPO", level="seq", needs_old=True,
                      ratio="pi_theta / pi_old (geometric mean)")
def _gspo(cfg, inputs, mask):
    return Ratio(seq_log_ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask), mask, "geometric_mean"))


@register_policy_loss("token_mis", paper="Token-MIS", level="token", needs_old=True, ratio="pi_theta / pi_old",
                      correction="`rho' 1{rho' <= C}`, `rho' = prod_t pi_old / pi_rollout`",
                      knobs=("mis_threshold", "mis_two_sided"))
def _token_mis(cfg, inputs, mask):
    weight, masked = _mis_weight(cfg, inputs, mask)
    return Ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask), weight, masked)


@register_policy_loss("seq_mis", paper="Seq-MIS", level="seq", needs_old=True, ratio="pi_theta / pi_old (seq_ratio)",
                      correction="`rho' 1{rho' <= C}`, `rho' = prod_t pi_old / pi_rollout`",
                      knobs=("seq_ratio", "mis_threshold", "mis_two_sided"))
def _seq_mis(cfg, inputs, mask):
    weight, masked = _mis_weight(cfg, inputs, mask)
    lr = seq_log_ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask), mask, cfg.seq_ratio)
    return Ratio(lr, weight, masked)


@register_policy_loss("token_tis", paper="Token-TIS", level="token", needs_old=True, ratio="pi_theta / pi_old",
                      correction="`min(pi_old / pi_rollout, C)` per token", knobs=("tis_threshold",))
def _token_tis(cfg, inputs, mask):
    old_vs_rollout = token_log_ratio(inputs.old_logprobs, inputs.rollout_logprobs, mask)
    weight = old_vs_rollout.clamp(max=math.log(cfg.tis_threshold)).exp().detach()
    return Ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask), weight)


@register_policy_loss("seq_bypass", paper="Seq-Bypass", level="seq", ratio="pi_theta / pi_rollout (seq_ratio)",
                      knobs=("seq_ratio",))
def _seq_bypass(cfg, inputs, mask):
    return Ratio(_seq_vs_rollout(cfg, inputs, mask))


@register_policy_loss("cispo", paper="CISPO (MiniMax-M1)", level="token", needs_old=True, clip=(1.0, 0.28),
                      objective="is_weighted", ratio="pi_theta / pi_old, in -sg(clip(r)) A log pi_theta")
def _cispo(cfg, inputs, mask):
    """MiniMax-M1 sets no lower bound on the IS weight (its eps_low is 'a large value'): default
    ``clip_low`` 1, i.e. r >= 0; only ``clip_high`` is tuned."""
    return Ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask))


@register_policy_loss("icepop", paper="IcePop (Ring-1T)", level="token", needs_old=True, ratio="pi_theta / pi_old",
                      correction="`k 1{alpha <= k <= beta}`, `k = pi_old / pi_rollout` per token",
                      knobs=("icepop_low", "icepop_high"))
def _icepop(cfg, inputs, mask):
    """Ring-1T's M(k): each token's objective is weighted by its train/engine ratio k and masked
    where k leaves ``[icepop_low, icepop_high]`` (the report's [0.5, 5]): both tails, token by token."""
    log_k = token_log_ratio(inputs.old_logprobs, inputs.rollout_logprobs, mask)
    keep = (log_k >= math.log(cfg.icepop_low)) & (log_k <= math.log(cfg.icepop_high))
    weight = torch.where(keep, log_k.clamp(max=math.log(cfg.icepop_high)).exp(), 0.0).detach()
    return Ratio(token_log_ratio(inputs.logprobs, inputs.old_logprobs, mask), weight, ~keep & mask)


# ------------------------------------------------------------------------------ the objective


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip_c: Optional[float]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO loss (to minimise) with asymmetric and dual clipping; also the bool maps of
    tokens where the low clip, the high clip and the dual clip are active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    low, high = clip_active & (ratio < 1.0), clip_active & (ratio > 1.0)
    dual = torch.zeros_like(low)
    if dual_clip_c is not None:
        negative = advantages < 0
        cap = -advantages * dual_clip_c
        dual = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, low, high, dual


def is_weighted_surrogate(
    ratio: Tensor, logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token CISPO loss ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi_theta`` (to minimise):
    every token keeps the gradient ``-w A grad log pi_theta``; also the bool maps of tokens whose
    weight the low and the high clip cut (no dual clip)."""
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    low, high = ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    return -advantages * weight * logprobs, low, high, torch.zeros_like(low)


def aggregate(values: Tensor, mask: Tensor, mode: str, global_tokens: float, global_seqs: float) -> Tensor:
    """Reduce per-token values over loss tokens; ``global_*`` are the mini-batch normalisers."""
    v = torch.where(mask, values, 0.0)
    if mode == "token-mean":
        return v.sum() / max(global_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return v.sum() / max(global_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return (v.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(global_seqs, 1.0)
    raise ValueError(
        f"loss.aggregation: unknown mode {mode!r}; expected token-mean, seq-mean-token-sum or seq-mean-token-mean"
    )


def loss_counts(mask: Tensor) -> tuple[float, float]:
    """Loss tokens and sequences with at least one loss token, the normalisers of ``mask``."""
    keep = mask > 0
    return float(keep.sum()), float(keep.any(-1).sum())


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str, clamp: float, bound: float) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on samples of pi: ``k1 = log pi - log pi_ref``,
    ``k3 = r - 1 - log r`` with ``r = pi_ref / pi`` (low variance, >= 0), bounded to
    ``[-bound, bound]``: k3 grows like ``exp(d)``, so one token far from the reference would
    otherwise dominate the gradient (a bounded token contributes no KL gradient, as in verl)."""
    d = token_log_ratio(ref_logprobs, logprobs, mask).clamp(-clamp, clamp)
    if kind == "k1":
        kl = -d
    elif kind == "k3":
        kl = d.exp() - d - 1.0
    else:
        raise ValueError(f"loss.kl_type: expected 'k1' or 'k3', got {kind!r}")
    return kl.clamp(-bound, bound)


def _check(cfg: LossConfig, spec: PolicyLoss, inputs: LossInputs) -> None:
    shape = tuple(inputs.logprobs.shape)
    if len(shape) != 2:
        raise ValueError(f"LossInputs.logprobs: expected [batch, tokens], got shape {shape}")
    for name in ("rollout_logprobs", "mask", "old_logprobs", "ref_logprobs", "entropy"):
        t = getattr(inputs, name)
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"LossInputs.{name}: expected shape {shape} like logprobs, got {tuple(t.shape)}")
    if tuple(inputs.advantages.shape) != shape[:1]:
        raise ValueError(f"LossInputs.advantages: expected one per sequence, shape {shape[:1]}, got {tuple(inputs.advantages.shape)}")
    if spec.needs_old and inputs.old_logprobs is None:
        raise ValueError(f"loss {cfg.name!r} needs LossInputs.old_logprobs (the old training policy)")
    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError(f"loss.kl_coef={cfg.kl_coef} needs LossInputs.ref_logprobs (the reference policy)")
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(
            f"loss.entropy_coef={cfg.entropy_coef} needs LossInputs.entropy (token_logprobs(..., with_entropy=True))"
        )
    for name in ("global_tokens", "global_seqs"):
        value = getattr(inputs, name)
        if value is not None and not value >= 0:
            raise ValueError(f"LossInputs.{name} must be >= 0 (got {value})")


def policy_loss(cfg: LossConfig, inputs: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's share of the mini-batch loss and its statistics (detached).

    Statistics: ``loss/policy``, ``loss/kl`` (kl_coef * KL), ``loss/entropy_bonus`` (entropy_coef *
    entropy) and ``loss/total`` (policy + kl - bonus), each this micro-batch's share; token counts
    ``count/clip_low``, ``count/clip_high``, ``count/clip_dual``, ``count/masked``; ``sum/kl_ref``
    (sum of the KL estimate over loss tokens, when ref_logprobs are given) and
    ``values/ratio_loss``, the log of the ratio the objective used (per loss token, or per
    sequence with loss tokens for sequence-level losses). :class:`~megatron_alp.training.step_metrics.StepMetrics`
    turns them into step metrics.
    """
    spec = get_policy_loss(cfg.name)
    _check(cfg, spec, inputs)
    mask = inputs.mask > 0
    local_tokens, local_seqs = loss_counts(mask)
    tokens = local_tokens if inputs.global_tokens is None else float(inputs.global_tokens)
    seqs = local_seqs if inputs.global_seqs is None else float(inputs.global_seqs)

    r = spec.ratio_fn(cfg, inputs, mask)
    log_ratio = r.log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    seq_level = log_ratio.dim() == 1
    if seq_level != (spec.level == "seq"):
        raise ValueError(f"policy loss {spec.name!r} is registered at {spec.level} level but its ratio has shape "
                         f"{tuple(log_ratio.shape)}")
    ratio = log_ratio.exp()
    if seq_level:
        ratio = ratio.unsqueeze(-1).expand_as(mask)
    adv = _wide(inputs.advantages).unsqueeze(-1).expand_as(mask)
    if spec.objective == "is_weighted":
        logprobs = torch.where(mask, _wide(inputs.logprobs), 0.0)
        per_token, low, high, dual = is_weighted_surrogate(ratio, logprobs, adv, *spec.clip_range(cfg))
    else:
        per_token, low, high, dual = clipped_surrogate(ratio, adv, *spec.clip_range(cfg), cfg.dual_clip_c)
    if r.weight is not None:
        per_token = per_token * r.weight
    policy = aggregate(per_token, mask, cfg.aggregation, tokens, seqs)

    zero = policy.new_zeros(())
    kl_term, bonus, stats = zero, zero, {}
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, mask, cfg.kl_type, cfg.log_ratio_clamp, cfg.kl_clamp)
        if cfg.kl_coef > 0:
            kl_term = cfg.kl_coef * aggregate(kl, mask, cfg.aggregation, tokens, seqs)
        stats["sum/kl_ref"] = torch.where(mask, kl, 0.0).sum().detach()
    if cfg.entropy_coef > 0:
        bonus = cfg.entropy_coef * aggregate(_wide(inputs.entropy), mask, cfg.aggregation, tokens, seqs)
    total = policy + kl_term - bonus

    active = mask if r.masked is None else mask & ~r.masked
    used = r.log_ratio.detach()
    used = used[mask.any(-1)] if seq_level else used[mask]
    stats.update({
        "loss/policy": policy.detach(),
        "loss/kl": kl_term.detach(),
        "loss/entropy_bonus": bonus.detach(),
        "loss/total": total.detach(),
        "count/clip_low": (low & active).sum().float(),
        "count/clip_high": (high & active).sum().float(),
        "count/clip_dual": (dual & active).sum().float(),
        "count/masked": (r.masked.sum().float() if r.masked is not None else zero.detach()),
        "values/ratio_loss": used,
    })
    return total, stats
