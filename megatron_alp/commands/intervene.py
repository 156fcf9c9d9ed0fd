"""`megatron-alp intervene CONFIG [KEY=VALUE ...] --checkpoint CKPT`: one policy update from one
checkpoint, applied twice, with and without ALP noise, and the log-ratio envelope after each (the
paper's controlled one-step intervention, Figure 3 middle/right).

Training shows the envelope of log r = log pi_train - log pi_rollout narrowing under ALP over a
whole run, where every later batch already depends on the method. This command isolates one
update: the rollout engine (the config's ``rollout`` settings, holding the checkpoint's weights)
samples ``rollout.sampling.n`` responses to ``--prompts`` training prompts, rewarded by the config's
reward with GRPO advantages (``advantage``), and each of two arms (``--compare A:B``, each
``LOSS``, ``LOSS@SIGMA`` or ``LOSS@auto``) takes ONE optimizer step on that whole batch from the
same starting point: the checkpoint's weights (and sigmas), the same optimizer state, the same
seeds, the same old and reference logprobs (unperturbed: the reference is the checkpoint itself).
The optimizer state is the checkpoint's when it has one (``--optimizer-state checkpoint``, the
default for a checkpoint saved by training: the step is the one training would take next, Adam
moments included), else fresh (zero moments; Adam's first step then moves every weight by about
the learning rate whatever its gradient's size, so the arms differ only through the gradients'
signs). The arms differ only in the loss and in whether the update's forward is perturbed (an
arm's model has perturbation sites when its loss is registered ``perturbed``, and, at sigma 0,
whenever the checkpoint's optimizer state holds sigma moments; ``@SIGMA`` sets every site's sigma
after loading, ``@0`` being exactly the unperturbed update; ``@auto`` calibrates it on the batch
as ``perturbation.init_std: auto`` does, :mod:`megatron_alp.training.calibration`). The update uses the
peak ``optimizer.lr`` (no warmup).

Each updated policy is then scored, unperturbed, on the same tokens, and measured against the
engine's logprobs as ``megatron-alp mismatch`` measures (:func:`~megatron_alp.commands.mismatch.mismatch_report`):
by engine token probability, with the envelope quantiles P2..P98. ``--seeds N`` repeats all this
on N prompt selections (seed, seed + 1, ...): ``before`` (the checkpoint against the engine), ``after``
(each updated policy against the engine), ``shift`` (each updated policy against the checkpoint)
and the update's clip fractions and ratio quantiles, per arm and seed; the summary counts the
(seed, bin) pairs where A's envelope width P98 - P2 is narrower than B's by more than 1% (closer
widths are a tie: one update moves them by about that much).

Writes ``OUT/intervene.json``, ``OUT/intervene.png`` and ``OUT/engine.log``, and prints a table. One
process, unsharded (TP = PP = 1), like ``megatron-alp mismatch``; docs/mismatch.md explains it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from matplotlib.figure import Figure
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_alp.algorithms.policy_loss import POLICY_LOSSES, needs_ref_logprobs
from megatron_alp.batches.sampling import rollout_params, sample, seeds_samples
from megatron_alp.batches.scoring import score
from megatron_alp.commands.context import library_log, model_dir, positive, refuse_torchrun, write_json
from megatron_alp.commands.session import Session
from megatron_alp.config import Config, InputError, TIRConfig
from megatron_alp.data.prompts import PromptSampler
from megatron_alp.diagnostics.mismatch_report import (
    ENVELOPE,
    describe,
    draw_envelope,
    engine_settings,
    mismatch_report,
    token_stats,
)
from megatron_alp.resolve import load_config
from megatron_alp.rewards import build_reward
from megatron_alp.runtime.console import held_warnings, say
from megatron_alp.training.dist_checkpoint import read_metadata
from megatron_alp.training.perturbation import perturbation_sites, set_sigmas
from megatron_alp.training.policy import weights_kind
from megatron_alp.training.rl_batch import training_batch
from megatron_alp.training.step_metrics import StepMetrics

MIN_BIN_TOKENS = 10  # a (seed, bin) enters the comparison with at least this many tokens
# widths within this relative difference are a tie: one update moves the envelope by a percent or less,
# and a difference of 0.02% is noise, not "narrower"
TIE = 0.01
UPDATE_KEYS = ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "ratio/p2", "ratio/p50", "ratio/p98",
               "ratio_loss/p2", "ratio_loss/p98", "loss/policy", "loss/total", "entropy/mean")


# ---------------------------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Arm:
    """One side of the comparison: a registered loss, and optionally the sigma every perturbation
    site is set to after loading (None: the checkpoint's sigmas, else ``perturbation.init_std``;
    ``"auto"``: calibrated on the batch as ``perturbation.init_std: auto`` does before training)."""

    name: str  # as written on the command line, e.g. ``alp_token@0``
    loss: str
    sigma: Optional[float | str] = None


def parse_arm(text: str) -> Arm:
    loss, at, value = text.strip().partition("@")
    if loss not in POLICY_LOSSES:
        raise InputError(f"--compare: unknown loss {loss!r} in arm {text!r}; expected LOSS or LOSS@SIGMA with LOSS "
                         f"one of {sorted(POLICY_LOSSES)}")
    if not at:
        return Arm(text.strip(), loss)
    if not POLICY_LOSSES[loss].perturbed:
        raise InputError(f"--compare: arm {text!r} sets a sigma on {loss}, whose update is not perturbed; "
                         "@SIGMA is for perturbed (alp_*) losses")
    if value == "auto":
        return Arm(text.strip(), loss, "auto")
    try:
        sigma = float(value)
    except ValueError:
        sigma = math.nan
    if not (math.isfinite(sigma) and sigma >= 0):
        raise InputError(f"--compare: arm {text!r}: expected @SIGMA with SIGMA a number >= 0 or auto (e.g. "
                         f"alp_token@0, alp_token@1e-3, alp_token@auto), got {value!r}")
    return Arm(text.strip(), loss, sigma)


def parse_compare(text: Optional[str], cfg: Config) -> tuple[Arm, Arm]:
    """``A:B`` as two arms; omitted: ``L:L@0`` with L the config's loss, when it is perturbed."""
    if text is None:
        loss = cfg.loss.name
        if not POLICY_LOSSES[loss].perturbed:
            raise InputError(f"--compare is needed: loss.name={loss} is not perturbed, so there is no noise to take "
                             "away; name the arms, e.g. --compare alp_seq:seq_bypass or alp_token:alp_token@0")
        return Arm(loss, loss), Arm(f"{loss}@0", loss, 0.0)
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise InputError(f"--compare: expected A:B with each arm LOSS or LOSS@SIGMA (e.g. alp_seq:seq_bypass), "
                         f"got {text!r}")
    a, b = (parse_arm(p) for p in parts)
    if a.name == b.name:
        raise InputError(f"--compare: both arms are {a.name!r}; compare two different arms")
    return a, b


def arm_config(path: str, overrides: list[str], arm: Arm) -> Config:
    """The run config with the arm's loss, re-validated with ``perturbation.enabled`` following the
    loss (clip defaults are the loss's own unless the config sets them) and no LR warmup: the one
    step is taken at ``optimizer.lr``."""
    return load_config(path, list(overrides) + [f"loss.name={arm.loss}", "perturbation.enabled=null",
                                                "optimizer.lr_warmup_steps=0"])


# ------------------------------------------------------------------------------------- measure


def saved_optimizer(checkpoint: str, kind: str) -> bool:
    """Whether CKPT holds optimizer state (a megatron-alp checkpoint saved by training)."""
    return kind == "megatron" and bool(read_metadata(checkpoint).get("has_optimizer"))


def arm_perturbation(arm: Arm, cfg: Config, checkpoint: str, optimizer_state: bool):
    """The perturbation sites of ARM's model. With the checkpoint's optimizer state every arm has
    the sites the checkpoint was saved with (its optimizer holds their moments in a group of their
    own, which must exist to be loaded; an unperturbed arm's are set to sigma 0, exactly the
    unperturbed forward), the arm's sigma learning rate; otherwise the arm's own config."""
    pert = cfg.perturbation
    if not optimizer_state:
        return pert
    saved = read_metadata(checkpoint).get("perturbation")
    if saved is None:
        if pert.enabled:
            raise InputError(f"--optimizer-state checkpoint: {checkpoint} was saved without ALP, so its optimizer "
                             f"holds no sigma state for arm {arm.name}; use --optimizer-state fresh")
        return pert
    return pert.model_copy(update={"enabled": True, "allow_with_baseline": True, "layers": saved["layers"],
                                   "shape": saved["shape"]})


def _rollout_batch(cfg: Config, engine, reward_fn, dataset, *, prompts: int, seed: int, pad: int):
    """One seed's batch as the trainer builds an iteration's: ``prompts`` training prompts drawn
    with ``seed``, ``n`` samples each (per-sample seeds from ``seed`` where the config seeds them),
    rewards (with the overlong punishment), GRPO advantages, truncated responses masked if asked."""
    s = cfg.rollout.sampling
    chosen = PromptSampler(dataset, seed=seed, shuffle=True).next_batch(prompts)
    params = rollout_params(s, seed if seeds_samples(s) else None)
    t0 = time.time()
    trajectories = sample(engine, [p.prompt_ids for p in chosen], params, TIRConfig())
    seconds = time.time() - t0
    rewards = torch.tensor(score(cfg, reward_fn, trajectories, chosen).rewards, dtype=torch.float32)
    batch, truncated = training_batch(cfg, trajectories, rewards, pad)
    first = torch.tensor([len(t.prompt_ids) - 1 for t in trajectories])  # column of each response's first target
    positions = torch.arange(batch.tokens.shape[1]).unsqueeze(0) - first.unsqueeze(1)
    info = {"seed": seed, "prompts": len(chosen), "samples": len(trajectories), "generation_s": seconds,
            "reward_mean": float(rewards.mean()), "groups_with_signal": int((batch.advantages.view(-1, s.n) != 0).any(1).sum()),
            "truncated_frac": float(truncated.float().mean()), "sampling_seed": params.seed}
    return batch, positions, info


def _update(arm: Arm, cfg: Config, batch, session: Session, *, seed: int, checkpoint: str, optimizer_state: bool,
            reference):
    """ARM's one step from the checkpoint on ``batch``: a fresh learner, with an optimizer fresh or
    with the checkpoint's state, identically seeded; returns old (unperturbed, before) and updated
    (unperturbed, after) logprobs, the update's metrics and the sigma the update was perturbed with."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    pert = arm_perturbation(arm, cfg, checkpoint, optimizer_state)
    pert = pert.model_copy(update={"seed": pert.seed + seed})
    learner = session.learner(cfg, checkpoint, perturbation=pert, optimizer_state=optimizer_state,
                              reference=reference if needs_ref_logprobs(cfg.loss) else None)
    sigma = 0.0 if pert.enabled and not cfg.perturbation.enabled else arm.sigma
    if isinstance(sigma, float):
        set_sigmas(learner.module, [sigma] * len(perturbation_sites(learner.module)))
    step_batch = dataclasses.replace(batch)
    learner.old_pass(step_batch)
    if learner.reference is not None:
        learner.reference_pass(step_batch)
    calibration = learner.calibrate(step_batch, iteration=0) if sigma == "auto" else {}
    sigma = learner.sigma_stats().get("sigma/mean")
    metrics = StepMetrics()
    stats = learner.step_on(step_batch, metrics)
    after = learner.logprobs(batch)
    noisy = None  # the updated perturbed policy, with the noise of the step after: the ratio ALP's next step clips
    if sigma:
        noisy = learner.logprobs(batch, perturb_step=1)
    reduced = metrics.reduce()
    update = {k: reduced[k] for k in UPDATE_KEYS}
    update.update(grad_norm=stats["grad_norm"], update_ok=stats["update_ok"], micro_batches=stats["micro_batches"],
                  **calibration)
    return step_batch.old_logprobs, after, noisy, update, sigma


def measure(cfg: Config, arms: dict[Arm, Config], *, checkpoint: str, model_dir: str, prompts: int, seeds: int,
            seed: int, optimizer_state: bool = False) -> tuple[dict, dict]:
    """Sample ``seeds`` batches with the engine, then give each arm its one update per batch;
    returns the report and the flat per-token logprobs (per seed: ``rollout``, ``positions``,
    and per arm ``old`` and ``after``)."""
    kind = weights_kind(checkpoint, "--checkpoint")
    s = cfg.rollout.sampling
    reward_fn = build_reward(cfg.reward)
    with Session(cfg, model_dir, seed=seed) as session:
        dataset = session.prompts("train", head=cfg.data.max_train_prompts)
        reference = session.scorer(checkpoint)  # the checkpoint, unperturbed: the engine's weights and the reference
        engine = session.engine()
        if kind == "megatron":
            session.sync_weights(reference)
        batches = [_rollout_batch(cfg, engine, reward_fn, dataset, prompts=prompts, seed=seed + i, pad=session.pad_id)
                   for i in range(seeds)]
        session.close_engine()
        per_seed, tokens = [], []
        for batch, positions, info in batches:
            keep = batch.loss_mask > 0
            rollout, pos = batch.rollout_logprobs[keep], positions[keep]
            flat = {"rollout": rollout, "positions": pos, "old": {}, "after": {}}
            entry = {**info, "tokens": int(keep.sum()), "arms": {}}
            for arm, arm_cfg in arms.items():
                old, after, noisy, update, sigma = _update(arm, arm_cfg, batch, session, seed=info["seed"],
                                                           checkpoint=checkpoint, optimizer_state=optimizer_state,
                                                           reference=reference)
                flat["old"][arm.name], flat["after"][arm.name] = old[keep], after[keep]
                entry["arms"][arm.name] = {
                    "sigma": sigma,
                    "before": mismatch_report(old[keep], rollout, pos, s.max_response_length),
                    "after": mismatch_report(after[keep], rollout, pos, s.max_response_length),
                    "after_perturbed": None if noisy is None else mismatch_report(noisy[keep], rollout, pos,
                                                                                  s.max_response_length),
                    "shift": token_stats(after[keep], old[keep], torch.ones_like(rollout, dtype=torch.bool)),
                    "update": update,
                }
            per_seed.append(entry)
            tokens.append(flat)
    names = [a.name for a in arms]
    pooled = {k: torch.cat([t[k] for t in tokens]) for k in ("rollout", "positions")}
    report = {
        "checkpoint": str(checkpoint),
        "checkpoint_kind": kind,
        "optimizer_state": "checkpoint" if optimizer_state else "fresh",
        "model": str(model_dir),
        "train_dtype": cfg.model.dtype,
        "engine": engine_settings(cfg),
        "sampling": {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "max_tokens": s.max_response_length},
        "prompt_files": list(cfg.data.train_files),
        "prompts": prompts,
        "seeds": [e["seed"] for e in per_seed],
        "arms": {a.name: {"loss": a.loss, "perturbed": POLICY_LOSSES[a.loss].perturbed, "sigma_set": a.sigma,
                          "lr": c.optimizer.lr, "clip_low": c.loss.clip_low, "clip_high": c.loss.clip_high,
                          "kl_coef": c.loss.kl_coef} for a, c in arms.items()},
        "per_seed": per_seed,
        "pooled": {
            "before": mismatch_report(torch.cat([t["old"][names[0]] for t in tokens]), pooled["rollout"],
                                      pooled["positions"], s.max_response_length)["by_probability"],
            **{n: mismatch_report(torch.cat([t["after"][n] for t in tokens]), pooled["rollout"], pooled["positions"],
                                  s.max_response_length)["by_probability"] for n in names},
        },
    }
    report["summary"] = summarize(per_seed, names)
    return report, {"per_seed": tokens}


# ------------------------------------------------------------------------------------- summary


def _narrower(a: float, b: float) -> bool:
    """Width ``a`` is narrower than ``b`` by more than :data:`TIE` (relative)."""
    return a < b * (1 - TIE)


def _width(stats: dict) -> float:
    return stats["log_ratio"]["p98"] - stats["log_ratio"]["p2"]


def summarize(per_seed: list[dict], names: list[str]) -> dict:
    """Per probability bin, each arm's seed-mean P2, P98 and envelope width P98 - P2 after the
    update over the seeds where the bin has >= ``MIN_BIN_TOKENS`` tokens; how often A's width is
    narrower than B's, over (seed, bin) pairs and over bins on the seed-mean; and each arm's
    all-token statistics, seed-mean."""
    a, b = names
    bins, narrower, pairs = [], 0, 0
    for i, first in enumerate(per_seed[0]["arms"][a]["after"]["by_probability"]):
        rows = [e["arms"] for e in per_seed if e["arms"][a]["after"]["by_probability"][i]["tokens"] >= MIN_BIN_TOKENS]
        entry = {"bin": first["bin"], "tokens": sum(e["arms"][a]["after"]["by_probability"][i]["tokens"]
                                                    for e in per_seed), "seeds": len(rows)}
        if rows:
            for n in names:
                stats = [r[n]["after"]["by_probability"][i] for r in rows]
                entry[n] = {"width": float(np.mean([_width(x) for x in stats])),
                            **{k: float(np.mean([x["log_ratio"][k] for x in stats])) for k in ENVELOPE}}
            before = [r[a]["before"]["by_probability"][i] for r in rows]
            entry["before"] = {"width": float(np.mean([_width(x) for x in before]))}
            pairs += len(rows)
            narrower += sum(_narrower(_width(r[a]["after"]["by_probability"][i]),
                                      _width(r[b]["after"]["by_probability"][i])) for r in rows)
        bins.append(entry)
    compared = [x for x in bins if x["seeds"]]
    overall = {}
    for n in names:
        runs = [e["arms"][n] for e in per_seed]
        overall[n] = {
            "width": float(np.mean([_width(r["after"]["all"]) for r in runs])),
            "kl_k3": float(np.mean([r["after"]["all"]["kl_k3"] for r in runs])),
            "shift_kl_k3": float(np.mean([r["shift"]["kl_k3"] for r in runs])),
            "perturbed": None if any(r["after_perturbed"] is None for r in runs) else {
                "width": float(np.mean([_width(r["after_perturbed"]["all"]) for r in runs])),
                "kl_k3": float(np.mean([r["after_perturbed"]["all"]["kl_k3"] for r in runs]))},
            **{k: float(np.mean([r["update"][k] for r in runs])) for k in ("clip/low_frac", "clip/high_frac",
                                                                            "clip/dual_frac", "grad_norm")},
        }
    overall["before"] = {"width": float(np.mean([_width(e["arms"][a]["before"]["all"]) for e in per_seed])),
                         "kl_k3": float(np.mean([e["arms"][a]["before"]["all"]["kl_k3"] for e in per_seed]))}
    return {"min_bin_tokens": MIN_BIN_TOKENS, "bins": bins, "all": overall,
            "narrower_pairs": int(narrower), "pairs": pairs,
            "narrower_bins": sum(_narrower(x[a]["width"], x[b]["width"]) for x in compared),
            "bins_compared": len(compared), "tie": TIE}


# ------------------------------------------------------------------------------------- output


def verdict(summary: dict, names: list[str]) -> str:
    a, b = names
    return (f"{a} narrower than {b} (by more than {100 * summary['tie']:g}%) in {summary['narrower_pairs']} of "
            f"{summary['pairs']} (seed, bin) pairs; in {summary['narrower_bins']} of {summary['bins_compared']} bins "
            "on the seed-mean")


def format_table(report: dict) -> str:
    """Per probability bin: tokens (all seeds), each arm's seed-mean envelope width P98 - P2 of log r
    after the update, B/A, and each arm's seed-mean P2..P98; then the all-token lines."""
    summary, names = report["summary"], list(report["arms"])
    a, b = names
    header = ["bin", "tokens", f"{a} width", f"{b} width", "B/A", f"{a} P2..P98", f"{b} P2..P98"]

    def row(name, tokens, x, y):
        return [name, str(tokens), f"{x['width']:.3e}", f"{y['width']:.3e}",
                f"{y['width'] / x['width']:.4f}" if x["width"] > 0 else "-",
                f"{x['p2']:+.2e}..{x['p98']:+.2e}", f"{y['p2']:+.2e}..{y['p98']:+.2e}"]

    lines = [header]
    for x in summary["bins"]:
        if x["seeds"]:
            lines.append(row(f"p {x['bin']}", x["tokens"], x[a], x[b]))
        else:
            lines.append([f"p {x['bin']}", str(x["tokens"])] + ["-"] * (len(header) - 2))
    runs = report["per_seed"]
    allq = {n: {"width": summary["all"][n]["width"], **{k: float(np.mean([e["arms"][n]["after"]["all"]["log_ratio"][k]
                                                                          for e in runs])) for k in ("p2", "p98")}}
            for n in names}
    lines.append(row("all", sum(e["tokens"] for e in runs), allq[a], allq[b]))
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                      for r in lines)
    o = summary["all"]
    clip = {n: "/".join(f"{o[n][k]:.4f}" for k in ("clip/low_frac", "clip/high_frac", "clip/dual_frac")) for n in names}
    return "\n".join([
        table,
        f"k3 KL vs rollout after the update: {a} {o[a]['kl_k3']:.3e}, {b} {o[b]['kl_k3']:.3e} "
        f"(before: {o['before']['kl_k3']:.3e}, all-token width {o['before']['width']:.3e})",
        f"policy shift k3 (updated vs checkpoint): {a} {o[a]['shift_kl_k3']:.3e}, {b} {o[b]['shift_kl_k3']:.3e}",
        *[f"{n} perturbed (the ratio its next step clips) vs rollout: all-token width {o[n]['perturbed']['width']:.3e}, "
          f"k3 {o[n]['perturbed']['kl_k3']:.3e}" for n in names if o[n]["perturbed"]],
        f"clip fractions low/high/dual: {a} {clip[a]}, {b} {clip[b]}; grad norm: {a} {o[a]['grad_norm']:.3e}, "
        f"{b} {o[b]['grad_norm']:.3e}",
        verdict(summary, names),
    ])


def draw_figure(report: dict, path: Path) -> None:
    """One panel per arm, side by side with a shared y-axis: the envelope of log r after the
    update by engine-probability bucket, tokens pooled over seeds, with the checkpoint's own
    (before) P2 and P98 as dashed grey lines."""
    names = list(report["arms"])
    fig = Figure(figsize=(13, 4.8))
    axes = fig.subplots(1, 2, sharey=True)
    before = report["pooled"]["before"]
    x = np.arange(len(before))
    for ax, name, color in zip(axes, names, ("tab:blue", "tab:orange")):
        draw_envelope(ax, report["pooled"][name], color=color)
        for k in ("p2", "p98"):
            ax.plot(x, [b["log_ratio"][k] if b["tokens"] else np.nan for b in before], ls="--", color="grey", lw=1,
                    label="before P2, P98" if k == "p2" else None)
        ax.set_title(name)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("log ratio  log(pi_updated / pi_rollout)")
    seeds = len(report["seeds"])
    fig.suptitle(f"One update from {Path(report['checkpoint']).name}, {describe(report)}: {report['prompts']} prompts x "
                 f"{report['sampling']['n']} samples x {seeds} seed{'s' * (seeds > 1)}\n"
                 f"{verdict(report['summary'], names)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


# ------------------------------------------------------------------------------------ command


def add_arguments(parser) -> None:
    parser.add_argument("config", help="run config (YAML): its model, optimizer, loss, perturbation, rollout, data, "
                                       "reward and advantage sections are used")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. optimizer.lr=1e-3 rollout.quantization=fp8_per_channel")
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="the starting point: a megatron-alp checkpoint (RUN/checkpoints/iter_N: weights and "
                             "sigmas; replaces model.load) or a Hugging Face model directory")
    parser.add_argument("--model", metavar="DIR",
                        help="Hugging Face directory of the architecture and tokenizer (default: CKPT when it is one, "
                             "else model.hf_path, else the run's base_model under trainer.output_dir)")
    parser.add_argument("--compare", metavar="A:B",
                        help="the two arms, each LOSS or LOSS@SIGMA (every perturbation site's sigma set to SIGMA; "
                             "@0: no noise; @auto: calibrated on the batch from the measured mismatch), e.g. "
                             "alp_seq:seq_bypass or alp_token:alp_token@0 "
                             "(default: L:L@0 with L = loss.name, when it is perturbed)")
    parser.add_argument("--optimizer-state", choices=("checkpoint", "fresh"),
                        help="the optimizer state both arms step from: the checkpoint's (default when CKPT was saved "
                             "with one) or fresh (zero Adam moments; the default otherwise)")
    parser.add_argument("--seeds", type=positive, default=1, metavar="N",
                        help="repeat on N prompt selections and rollout batches, seeded S, S+1, ... (default: 1)")
    parser.add_argument("--prompts", type=positive, metavar="N",
                        help="training prompts per batch (default: trainer.prompts_per_iteration)")
    parser.add_argument("--seed", type=int, metavar="S", help="base seed (default: trainer.seed)")
    parser.add_argument("--out", metavar="DIR",
                        help="output folder for intervene.json, intervene.png and engine.log "
                             "(default: <trainer.output_dir>/intervene/<A>_vs_<B>)")


def run(args) -> int:
    refuse_torchrun("intervene")
    with held_warnings():
        cfg = load_config(args.config, args.overrides)
        a, b = parse_compare(args.compare, cfg)
        arms = {arm: arm_config(args.config, args.overrides, arm) for arm in (a, b)}
        kind = weights_kind(args.checkpoint, "--checkpoint")
        has_state = saved_optimizer(args.checkpoint, kind)
        if args.optimizer_state == "checkpoint" and not has_state:
            raise InputError(f"--optimizer-state checkpoint: {args.checkpoint} holds no optimizer state "
                             "(a Hugging Face directory, or a checkpoint saved without one); use --optimizer-state fresh")
        optimizer_state = has_state if args.optimizer_state is None else args.optimizer_state == "checkpoint"
    model = str(model_dir(cfg, args.model or (args.checkpoint if kind == "hf" else None)))
    seed = cfg.trainer.seed if args.seed is None else args.seed
    prompts = args.prompts or cfg.trainer.prompts_per_iteration
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "intervene" / f"{a.name}_vs_{b.name}"
    with library_log(out / "engine.log", "intervene"):
        report, _ = measure(cfg, arms, checkpoint=args.checkpoint, model_dir=model, prompts=prompts,
                            seeds=args.seeds, seed=seed, optimizer_state=optimizer_state)
        draw_figure(report, out / "intervene.png")
    write_json(out / "intervene.json", report)
    rewards = ", ".join(f"{e['reward_mean']:.3f}" for e in report["per_seed"])
    say(f"{describe(report)}: one update of {a.name} and of {b.name} from {args.checkpoint} "
        f"({report['optimizer_state']} optimizer state), {prompts} prompts x "
        f"{cfg.rollout.sampling.n} samples x {args.seeds} seed(s), {sum(e['tokens'] for e in report['per_seed'])} "
        f"tokens; reward mean per seed {rewards}")
    say(format_table(report))
    say(f"written: {out / 'intervene.json'}, {out / 'intervene.png'}")
    return 0
