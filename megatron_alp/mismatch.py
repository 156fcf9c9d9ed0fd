"""`megatron-alp mismatch CONFIG [KEY=VALUE ...]`: the training-inference mismatch of a config's
engine settings, measured on one probe batch, without training.

Training logs the mismatch as whole-batch averages per iteration (``mismatch/*``), once a run is
under way. This command measures it before any run, for whichever engine setting is being weighed,
and says where it sits: the rollout engine, started as the trainer starts it (``rollout.dtype``,
``quantization``, ``kv_cache_dtype``, ``tensor_parallel_size``, ``rollout.sampling``), samples
``n`` responses to the first ``--prompts`` prompts of ``data.val_files`` (else
``data.train_files``), and the Megatron model (``model.dtype``, unperturbed) scores the same tokens
with the same weights (those of ``model.load``, when set, are synced into the engine as in
training), so every difference is numerics.

With log r = log pi_train - log pi_rollout per response token, the report gives, over all tokens
and per bucket of engine token probability and of response position, the trainer's own statistics
(:class:`~megatron_alp.metrics.StepMetrics`: ``kl_k1``, ``kl_k3``, ``chi2``, ``pearson_r``, ratio
quantiles), |log r| as the weight-sync check reports it
(:func:`~megatron_alp.rollout.weight_sync.mismatch_stats`), and the log-ratio quantiles the figure
draws: the paper's conditional envelope, where low-probability tokens carry the tail.

Writes ``OUT/mismatch.json``, ``OUT/mismatch.png`` and ``OUT/engine.log`` (engine and library
output), and prints a table. One process, like ``megatron-alp eval``: the Megatron model is scored
unsharded (TP = PP = 1; the config's ``parallel`` section is for training). docs/mismatch.md
explains the numbers.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_alp.config import Config, InputError, RolloutConfig, load_config
from megatron_alp.console import library_output_to, say
from megatron_alp.evaluate import resolve_model
from megatron_alp.metrics import StepMetrics
from megatron_alp.policy_loss import LossInputs
from megatron_alp.rollout.weight_sync import mismatch_stats

# Engine token-probability buckets: [0, 0.1), [0.1, 0.5), [0.5, 0.9), [0.9, 0.99), [0.99, 1].
PROB_EDGES = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
POSITION_BINS = 4  # equal ranges of the response budget, the same for every engine setting
ENVELOPE = {"p2": 0.02, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p98": 0.98}  # log-ratio quantiles drawn
SCATTER_POINTS = 20000


# ---------------------------------------------------------------------------------- statistics


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


# ------------------------------------------------------------------------------------- probe


def measure(cfg: Config, model_dir: str, *, prompts: int, n: Optional[int], max_tokens: Optional[int],
            seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Sample the probe with the config's engine, score it with the Megatron model; returns the
    report (:func:`mismatch_report` plus what was measured) and the flat train and rollout logprobs."""
    import torch.distributed as dist

    from megatron_alp.calibration import calibrate_sigma
    from megatron_alp.config import ParallelConfig
    from megatron_alp.data import PromptDataset, load_tokenizer
    from megatron_alp.models.builder import build_gpt_model
    from megatron_alp.models.families import hf_to_megatron, load_hf_config
    from megatron_alp.models.hf_weights import load_hf_weights
    from megatron_alp.parallel import destroy_distributed, init_distributed
    from megatron_alp.perturbation import sigma_stats
    from megatron_alp.platform import has_gpu
    from megatron_alp.micro_batch import Batching
    from megatron_alp.policy_update import compute_logprobs, probe_mismatch
    from megatron_alp.rl_batch import build_rl_batch
    from megatron_alp.rollout import DistributedRollout, SamplingParams, Trajectory

    s = cfg.rollout.sampling
    n = n or s.n
    max_tokens = min(max_tokens or s.max_response_length, s.max_response_length)
    split = "val" if cfg.data.val_files else "train"
    tokenizer = load_tokenizer(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = PromptDataset.from_config(cfg.data, tokenizer, s.max_prompt_length, split=split).head(prompts)
    # The engine's context follows the probe's response budget, as the trainer's follows its own.
    probe = s.model_copy(update={"n": n, "max_response_length": max_tokens})
    rollout_cfg = cfg.rollout.model_copy(update={"sampling": probe})
    seeded = s.per_sample_seeds if s.per_sample_seeds is not None else not has_gpu()
    params = SamplingParams(n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
                            seed=seed if seeded else None)
    parallel = ParallelConfig()
    owns_groups = not dist.is_initialized()
    init_distributed(parallel, seed=seed)
    try:
        # the config's ALP sites (the unperturbed passes never see them) for the sigma calibration below
        model = build_gpt_model(hf_to_megatron(load_hf_config(model_dir)), cfg.model, parallel, cfg.perturbation,
                                moe=cfg.moe)
        if cfg.model.load is not None:
            from megatron_alp.dist_checkpoint import load_checkpoint

            load_checkpoint(cfg.model.load, model)
        else:
            load_hf_weights(model, model_dir)
        engine = DistributedRollout(rollout_cfg, model_dir, seed=seed, scorer=probe_mismatch)
        try:
            if cfg.model.load is not None:
                engine.sync_weights(model)
            t0 = time.time()
            groups = engine.generate([p.prompt_ids for p in data], params)
            seconds = time.time() - t0
        finally:
            engine.shutdown()
        trajectories = [Trajectory.from_completion(c) for g in groups for c in g]
        batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id)
        logprob_pass = dict(batching=Batching.for_logprobs(cfg.trainer), temperature=s.temperature, pad_id=pad_id,
                            fused=cfg.trainer.fused_linear_logprobs)
        train_lp = compute_logprobs(model, batch, **logprob_pass)
        calibration = None
        if cfg.perturbation.enabled:
            batch.old_logprobs = train_lp
            calibration = calibrate_sigma(model, batch, cfg.perturbation, iteration=0, **logprob_pass)
            calibration["sigma"] = {k.split("/")[1]: v for k, v in sigma_stats(model).items() if k.endswith("/mean")}
    finally:
        if owns_groups:
            destroy_distributed()
    keep = batch.loss_mask > 0
    first = torch.tensor([len(t.prompt_ids) - 1 for t in trajectories])  # column of each response's first target
    positions = (torch.arange(batch.tokens.shape[1]).unsqueeze(0) - first.unsqueeze(1))[keep]
    train, rollout = train_lp[keep], batch.rollout_logprobs[keep]
    report = {
        "model": str(model_dir),
        "checkpoint": cfg.model.load,
        "train_dtype": cfg.model.dtype,
        "engine": {k: getattr(cfg.rollout, k) for k in ("engine", "dtype", "quantization", "kv_cache_dtype",
                                                        "tensor_parallel_size")},
        "sampling": {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "max_tokens": max_tokens, "seed": params.seed},
        "prompt_files": list(cfg.data.val_files or cfg.data.train_files),
        "prompts": len(data),
        "samples": len(trajectories),
        "generation_s": seconds,
        "tokens_per_s": int(keep.sum()) / max(seconds, 1e-9),
        **mismatch_report(train, rollout, positions, max_tokens),
        "calibration": calibration,
    }
    return report, train, rollout


def setting_name(cfg: Config) -> str:
    """Folder name of the compared settings (``train-float32_vllm-bfloat16-fp8_per_channel``), so
    the reports of several settings sit side by side under ``RUN/mismatch``."""
    r: RolloutConfig = cfg.rollout
    engine = [r.engine, r.dtype] + [r.quantization] * (r.quantization != "none")
    engine += [f"kv_{r.kv_cache_dtype}"] * (r.kv_cache_dtype != "auto")
    engine += [f"tp{r.tensor_parallel_size}"] * (r.tensor_parallel_size > 1)
    return f"train-{cfg.model.dtype}_{'-'.join(engine)}"


# ------------------------------------------------------------------------------------ output


def describe(report: dict) -> str:
    e = report["engine"]
    quant = "" if e["quantization"] == "none" else f" {e['quantization']}"
    kv = "" if e["kv_cache_dtype"] == "auto" else f" kv-cache {e['kv_cache_dtype']}"
    return f"{e['engine']} {e['dtype']}{quant}{kv} vs Megatron {report['train_dtype']}"


def format_table(report: dict) -> str:
    """All tokens, then each probability and position bucket: tokens, KL k1/k3, chi-square, |log r|."""
    header = ["bucket", "tokens", "k1 KL", "k3 KL", "chi2", "mean|log r|", "P98|log r|", "max|log r|"]
    rows = [("all", report["all"])] + [(f"p {b['bin']}", b) for b in report["by_probability"]] \
        + [(f"pos {b['bin']}", b) for b in report["by_position"]]
    lines = [header]
    for name, s in rows:
        if not s["tokens"]:
            lines.append([name, "0"] + ["-"] * (len(header) - 2))
            continue
        a = s["abs_log_ratio"]
        lines.append([name, str(s["tokens"])] + [f"{v:.3e}" for v in (s["kl_k1"], s["kl_k3"], s["chi2"], a["mean"],
                                                                        a["p98"], a["max"])])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in lines)


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


def draw_figure(report: dict, train: torch.Tensor, rollout: torch.Tensor, path: Path) -> None:
    """Left: P2-P98 and P25-P75 of log r with the median, per engine-probability bucket (the
    paper's conditional envelope). Right: training vs rollout probability of every token (a seeded
    subsample beyond ``SCATTER_POINTS``), as ``megatron-alp plot``'s scatter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_alp.plot import probability_scatter

    fig, (env, sc) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    draw_envelope(env, report["by_probability"])
    env.set_ylabel("log ratio  log(pi_train / pi_rollout)")
    env.set_title("Log-ratio envelope by token probability")
    env.legend(fontsize=8)

    probability_scatter(sc, train.double().exp().numpy(), rollout.double().exp().numpy(), SCATTER_POINTS,
                        size=4, alpha=0.4)
    sc.set_title(f"Token probabilities\nPearson r = {report['all']['pearson_r']:.4f} (n = {report['all']['tokens']})")
    a = report["all"]
    fig.suptitle(f"{describe(report)}: k3 KL {a['kl_k3']:.2e}, max|log r| {a['abs_log_ratio']['max']:.2e}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _json_ready(value):
    """NaN (a statistic undefined on a bucket, e.g. Pearson r of one token) as null: strict JSON."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ----------------------------------------------------------------------------------- command


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("config", help="run config (YAML); its model, rollout and data sections are used")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. rollout.dtype=float32 "
                             "rollout.quantization=fp8_per_channel")
    parser.add_argument("--model", metavar="DIR",
                        help="Hugging Face model directory (default: model.hf_path, else the run's base_model under "
                             "trainer.output_dir)")
    parser.add_argument("--prompts", type=_positive, default=64, metavar="N",
                        help="probe the first N prompts of data.val_files, else data.train_files (default: 64)")
    parser.add_argument("--n", type=_positive, metavar="N", help="samples per prompt (default: rollout.sampling.n)")
    parser.add_argument("--max-tokens", type=_positive, metavar="N",
                        help="response length cap (default and upper bound: rollout.sampling.max_response_length)")
    parser.add_argument("--seed", type=int, metavar="S", help="engine and sampling seed (default: trainer.seed)")
    parser.add_argument("--out", metavar="DIR",
                        help="output folder for mismatch.json, mismatch.png and engine.log "
                             "(default: <trainer.output_dir>/mismatch/train-<model.dtype>_<engine settings>)")


def run(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError("megatron-alp mismatch runs in one process: start it without torchrun")
    # Validation imports the engines and Megatron-Core: their import-time warnings go to the log.
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("default")
        cfg = load_config(args.config, args.overrides)
    model_dir = resolve_model(cfg, args.model)
    seed = cfg.trainer.seed if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "mismatch" / setting_name(cfg)
    with library_output_to(out / "engine.log") as log:
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        say(f"megatron-alp mismatch: engine and library output goes to {log}")
        report, train, rollout = measure(cfg, model_dir, prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
                                         seed=seed)
        draw_figure(report, train, rollout, out / "mismatch.png")
    (out / "mismatch.json").write_text(json.dumps(_json_ready(report), indent=2) + "\n")
    say(f"{describe(report)}: {report['prompts']} prompts x {report['sampling']['n']} samples, "
        f"{report['all']['tokens']} tokens ({report['tokens_per_s']:.0f} tokens/s)")
    say(format_table(report))
    cal = report["calibration"]
    if cal:
        sigmas = ", ".join(f"{k} {v:.3g}" for k, v in cal["sigma"].items())
        say(f"perturbation.init_std: auto would set sigma = {cal['calibration/scale']:.3g} x layer-input RMS ({sigmas}): "
            f"KL(train || perturbed) {cal['calibration/perturbed_kl']:.3g} for a target of "
            f"{cal['calibration/target_kl']:.3g} (perturbation.calibration_target x the k3 KL above)")
    say(f"written: {out / 'mismatch.json'}, {out / 'mismatch.png'}")
    return 0
