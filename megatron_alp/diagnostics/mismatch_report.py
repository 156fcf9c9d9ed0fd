"""The training-inference mismatch of a set of sampled tokens, reported the way the paper reads it:
over all tokens, and per bucket of engine token probability and of response position.

With log r = log pi_train - log pi_rollout per response token, each bucket gets the trainer's own
statistics (:class:`~megatron_alp.training.step_metrics.StepMetrics`: ``kl_k1``, ``kl_k3``, ``chi2``,
``pearson_r``, ratio quantiles), |log r| as the weight-sync check reports it
(:func:`~megatron_alp.algorithms.mismatch.mismatch_stats`), and the log-ratio quantiles of the
paper's conditional envelope, where low-probability tokens carry the tail. ``megatron-alp
mismatch`` and ``megatron-alp intervene`` report with it.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from megatron_alp.algorithms.mismatch import mismatch_stats
from megatron_alp.algorithms.policy_loss import LossInputs
from megatron_alp.training.step_metrics import StepMetrics

# Engine token-probability buckets: [0, 0.1), [0.1, 0.5), [0.5, 0.9), [0.9, 0.99), [0.99, 1].
PROB_EDGES = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
POSITION_BINS = 4  # equal ranges of the response budget, the same for every engine setting
ENVELOPE = {"p2": 0.02, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p98": 0.98}  # log-ratio quantiles drawn
SCATTER_POINTS = 20000



def token_stats(train: torch.Tensor, rollout: torch.Tensor, keep: torch.Tensor) -> dict:
    """Mismatch of the tokens selected by ``keep`` (flat logprobs of the same tokens), with the
    trainer's definitions so the numbers read like its ``mismatch/*`` and ``ratio/*`` metrics;
    ``{"tokens": 0}`` for an empty selection."""
    n = int(keep.sum())
    if n == 0:
        return {"tokens": 0}
    metrics = StepMetrics()
    # StepMetrics also accumulates the loss's statistics; there is no loss here, so they are zeros.
    metrics.add(LossInputs(logprobs=train, rollout_logprobs=rollout, advantages=train.new_zeros(1), mask=keep),
                defaultdict(lambda: torch.zeros(())))
    m = metrics.reduce()
    sync = mismatch_stats(rollout[keep], train[keep])
    log_r = (train[keep].double() - rollout[keep].double()).numpy()
    return {
        "tokens": n,
        "kl_k1": m["mismatch/kl_k1"],
        "kl_k3": m["mismatch/kl_k3"],
        "chi2": m["mismatch/chi2"],
        "pearson_r": m["mismatch/pearson_r"],
        "abs_log_ratio": {k: sync[k] for k in ("mean", "p98", "max")},
        "log_ratio": dict(zip(ENVELOPE, np.quantile(log_r, list(ENVELOPE.values())).tolist())),
        "ratio": {k.removeprefix("ratio/"): v for k, v in m.items() if k.startswith("ratio/")},
    }


def _buckets(train, rollout, values: np.ndarray, edges, labels) -> list[dict]:
    index = np.digitize(values, edges[1:-1])  # the last bucket is closed on the right
    return [{"bin": label, "low": lo, "high": hi, **token_stats(train, rollout, torch.from_numpy(index == i))}
            for i, (label, lo, hi) in enumerate(zip(labels, edges[:-1], edges[1:]))]


def position_edges(max_tokens: int) -> list[int]:
    """Bucket edges of response positions: ``POSITION_BINS`` equal ranges of ``[0, max_tokens)``."""
    return sorted({round(x) for x in np.linspace(0, max_tokens, POSITION_BINS + 1)})


def mismatch_report(train: torch.Tensor, rollout: torch.Tensor, positions: torch.Tensor, max_tokens: int) -> dict:
    """:func:`token_stats` of all tokens, by engine token probability and by response position
    (0-based index in the response), from flat per-token logprobs."""
    train, rollout = train.float().reshape(-1), rollout.float().reshape(-1)
    prob_labels = [f"[{lo:g}, {hi:g})" for lo, hi in zip(PROB_EDGES, PROB_EDGES[1:])]
    prob_labels[-1] = prob_labels[-1][:-1] + "]"
    pos_edges = position_edges(max_tokens)
    pos_labels = [f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo) for lo, hi in zip(pos_edges, pos_edges[1:])]
    return {
        "all": token_stats(train, rollout, torch.ones_like(train, dtype=torch.bool)),
        "by_probability": _buckets(train, rollout, rollout.double().exp().numpy(), PROB_EDGES, prob_labels),
        "by_position": _buckets(train, rollout, positions.reshape(-1).numpy(), pos_edges, pos_labels),
    }


ENGINE_SETTINGS = ("engine", "dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size")


def engine_settings(cfg) -> dict:
    """The rollout keys a mismatch depends on (a report's ``engine``)."""
    return {k: getattr(cfg.rollout, k) for k in ENGINE_SETTINGS}


def describe(report: dict) -> str:
    """``vllm bfloat16 fp8_per_channel vs Megatron float32``: the compared settings of a report."""
    e = report["engine"]
    quant = "" if e["quantization"] == "none" else f" {e['quantization']}"
    kv = "" if e["kv_cache_dtype"] == "auto" else f" kv-cache {e['kv_cache_dtype']}"
    return f"{e['engine']} {e['dtype']}{quant}{kv} vs Megatron {report['train_dtype']}"


def draw_envelope(ax, bins: list[dict], color: str = "tab:blue") -> None:
    """The conditional envelope of log r on ``ax``: per engine-probability bucket of ``bins`` (a
    report's ``by_probability``), P2-P98 light, P25-P75 dark and the median, with a zero line."""
    x = np.arange(len(bins))
    q = {k: np.array([b["log_ratio"][k] if b["tokens"] else np.nan for b in bins]) for k in ENVELOPE}
    ax.fill_between(x, q["p2"], q["p98"], color=color, alpha=0.2, label="P2-P98")
    ax.fill_between(x, q["p25"], q["p75"], color=color, alpha=0.4, label="P25-P75")
    ax.plot(x, q["p2"], "_", x, q["p98"], "_", color=color, ms=14)  # visible where a bucket stands alone
    ax.plot(x, q["p50"], "o-", color=color, lw=1.2, label="median")
    ax.axhline(0.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x, [f"{b['bin']}\n{b['tokens']} tok" for b in bins])
    ax.set_xlabel("rollout-engine token probability")
    ax.grid(True, alpha=0.3)
