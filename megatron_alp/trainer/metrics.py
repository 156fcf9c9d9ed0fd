"""An iteration's metrics, assembled from what its phases returned, by pure functions.

Each function turns one product of the iteration into its flat ``group/name`` metrics: the
sampled batch (:func:`batch_metrics`), the trajectories' policy versions
(:func:`staleness_metrics`), the optimizer steps (:func:`update_metrics`) and the throughput
(:func:`throughput_metrics`), and the run's end (:func:`run_summary`). The loss statistics come reduced from the update
(:class:`~megatron_alp.training.step_metrics.StepMetrics`), one dict per step, averaged by
:func:`mean_dicts`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from megatron.core import parallel_state as ps

from megatron_alp.algorithms.dynamic_sampling import Groups, zero_variance
from megatron_alp.batches.scoring import overlong_penalties
from megatron_alp.config import Config
from megatron_alp.runtime.run_log import save_token_probs
from megatron_alp.tir.multi_turn import tir_metrics
from megatron_alp.training.policy_update import from_last_stage


def mean_dicts(dicts: list[dict]) -> dict:
    """Per key over ``dicts`` (finite numbers only): the min of ``*/min``, the max of ``*/max``,
    else the mean."""
    keys = {k for d in dicts for k in d}
    out = {}
    for k in sorted(keys):
        vals = [d[k] for d in dicts if k in d and isinstance(d[k], (int, float)) and np.isfinite(d[k])]
        if not vals:
            continue
        if k.endswith("/min"):
            out[k] = float(min(vals))
        elif k.endswith("/max"):
            out[k] = float(max(vals))
        else:
            out[k] = float(np.mean(vals))
    return out


def staleness_metrics(trajectories, iteration: int, partial_rollout: bool) -> dict:
    """How many weight versions behind the trained policy each trajectory was generated."""
    staleness = np.array([iteration - t.policy_version for t in trajectories], dtype=np.float64)
    out = {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())}
    if partial_rollout:
        out["staleness/multi_version_frac"] = float(np.mean(
            [len(t.info.get("version_spans", ())) > 1 for t in trajectories]))
    return out


def data_metrics(resume_state: dict) -> dict:
    """``data/epoch``: the epochs of prompts trained on (where a resume restarts the sampler), in
    fractions of an epoch."""
    return {"data/epoch": resume_state["epoch"] + resume_state["position"] / resume_state["num_prompts"]}


def batch_metrics(cfg: Config, groups: Groups, truncated: torch.Tensor) -> dict:
    """Rewards, response lengths and truncation of the trained batch; tool use in TIR runs."""
    rewards, trajectories = groups.rewards, groups.trajectories
    resp = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    truncated_frac = truncated.float().mean().item()
    out = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "response_length/mean": resp.mean().item(),
        "response_length/max": resp.max().item(),
        "response/truncated_frac": truncated_frac,
        "response/masked_truncated_frac": truncated_frac if cfg.loss.mask_truncated else 0.0,
        "reward/overlong_penalty_mean": float(np.mean(overlong_penalties(cfg, trajectories))),
        "batch/groups": float(len(groups)),
        "batch/zero_variance_groups": float(zero_variance(rewards, cfg.rollout.sampling.n).sum()),
    }
    if cfg.tir.enabled:
        out.update(tir_metrics(trajectories))
    return out


def update_metrics(step_stats: list[dict]) -> dict:
    """The optimizer steps of the iteration: micro-batches, padding, gradient norm, skipped steps."""
    return {
        "batch/micro_batches": float(np.mean([s["micro_batches"] for s in step_stats])),
        "batch/padding_frac": 1.0 - sum(s["tokens"] for s in step_stats) / max(
            1, sum(s["computed_tokens"] for s in step_stats)),
        "grad_norm": float(np.mean([s["grad_norm"] for s in step_stats])),
        "update/skipped": float(sum(not s["update_ok"] for s in step_stats)),
    }


def throughput_metrics(tokens: float, timing: dict) -> dict:
    """Tokens per second of the whole iteration, and the engines' generated tokens per second."""
    return {
        "throughput/tokens_per_s": tokens / max(timing["timing/total_s"], 1e-9),
        "throughput/rollout_tokens_per_s": timing["rollout/response_tokens"] / max(timing["timing/rollout_s"], 1e-9),
    }


def iteration_metrics(cfg: Config, groups: Groups, share, *, step: int, loss_metrics: list[dict],
                      step_stats: list[dict], data_state: dict, learner_metrics: dict, measured: dict) -> dict:
    """An iteration's record: the loss metrics (from the last pipeline stage), the batch, the data
    position, the update, the learner's rates, sigmas and routing, what the phases measured, and
    the throughput."""
    out = from_last_stage({"step": step, **mean_dicts(loss_metrics)})
    out.update(batch_metrics(cfg, groups, share.truncated))
    out.update(data_metrics(data_state))
    out.update(update_metrics(step_stats))
    out.update(learner_metrics)
    out.update(measured)
    out.update(throughput_metrics(float(share.batch.lengths.sum().item()), measured))
    return out


def run_summary(records: list[dict], seconds: float, run_dir: Path, k: int,
                held_ahead: Optional[dict] = None) -> tuple[list[str], dict[str, float]]:
    """The end of a run for the terminal (lines) and the trackers (numbers): its length, the mean
    reward of its first and last ten iterations, validation average@``k`` of the base model and at
    the end, where its files are, and the most groups generated ahead that one of its checkpoints
    held (``held_ahead``: :attr:`~megatron_alp.trainer.checkpointer.Checkpointer.held_ahead`)."""
    trained = [r for r in records if r.get("iteration", -1) >= 0]
    values = {"summary/seconds": seconds, "summary/iterations": float(len(trained))}
    lines = [f"run finished in {seconds / 60:.1f} min: {len(trained)} iterations"]
    rewards = [r["reward/mean"] for r in trained if "reward/mean" in r]
    if rewards:
        head, tail = rewards[:10], rewards[-10:]
        values.update({"summary/reward_first": float(np.mean(head)), "summary/reward_last": float(np.mean(tail))})
        lines[0] += (f"; reward {values['summary/reward_first']:.3f} (first {len(head)}) -> "
                     f"{values['summary/reward_last']:.3f} (last {len(tail)})")
    val = [(r["iteration"], r["val/reward_mean"]) for r in records if "val/reward_mean" in r]
    if val:
        first, last = val[0], val[-1]
        values.update({"summary/val_first": first[1], "summary/val_last": last[1]})
        start = "base model" if first[0] < 0 else f"after iteration {first[0]}"
        lines[0] += f"; validation average@{k} {100 * first[1]:.1f}% ({start}) -> {100 * last[1]:.1f}%"
    ckpts = sorted((run_dir / "checkpoints").glob("iter_*")) if (run_dir / "checkpoints").is_dir() else []
    if held_ahead:
        values.update({"summary/ahead_groups": float(held_ahead["groups"]),
                       "summary/ahead_bytes": float(held_ahead["bytes"])})
        versions = ", ".join(str(v) for v in held_ahead["versions"])
        lines.append(f"checkpoints held up to {held_ahead['groups']} groups generated ahead (weight versions "
                     f"{versions}: {held_ahead['bytes'] / 2**20:.2f} MiB in {held_ahead['checkpoint']})")
    where = [f"checkpoints {ckpts[-1]}" if ckpts else None, f"metrics {run_dir / 'metrics.jsonl'}",
             f"figures {run_dir / 'plots'}/" if (run_dir / "plots").is_dir() else None,
             f"config {run_dir / 'config.yaml'}", f"log {run_dir / 'logs' / 'engine.log'}"]
    lines.append("wrote " + ", ".join(w for w in where if w))
    return lines, values


def dump_token_probs(n: int, local, run_dir: Path, iteration: int) -> None:
    """Up to ``n`` (train: old, unperturbed; rollout) token probability pairs of ``local``, the
    rank's batch, saved by the one rank that has both (last pipeline stage, first TP and DP rank)."""
    if not n or local.old_logprobs is None or not ps.is_pipeline_last_stage():
        return
    if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
        return
    keep = local.loss_mask > 0
    train = local.old_logprobs[keep].exp().numpy()
    rollout = local.rollout_logprobs[keep].exp().numpy()
    if len(train) > n:
        idx = np.random.default_rng(iteration).choice(len(train), n, replace=False)
        train, rollout = train[idx], rollout[idx]
    save_token_probs(run_dir, iteration, train, rollout)
