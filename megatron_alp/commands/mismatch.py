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

The report (:mod:`megatron_alp.diagnostics.mismatch_report`) gives, over all tokens and per bucket
of engine token probability and of response position, the trainer's own statistics, |log r| and
the log-ratio quantiles the figure draws: the paper's conditional envelope. With ALP configured,
it also says which sigmas ``perturbation.init_std: auto`` would choose for these settings.

With ``--layers N`` it also says where the mismatch comes from: the first N sampled sequences go
through both models once more, and :mod:`megatron_alp.diagnostics.layer_divergence` compares their
hidden states layer by layer (``layers`` in mismatch.json, ``OUT/layers.png``).

Writes ``OUT/mismatch.json``, ``OUT/mismatch.png`` and ``OUT/engine.log`` (engine and library
output), and prints a table. One process, like ``megatron-alp eval``: the Megatron model is scored
unsharded (TP = PP = 1; the config's ``parallel`` section is for training). docs/mismatch.md
explains the numbers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
from matplotlib.figure import Figure

from megatron_alp.batches.sampling import rollout_params, sample, seeds_samples
from megatron_alp.commands.context import library_log, model_dir, positive, refuse_torchrun, write_json
from megatron_alp.commands.session import Session
from megatron_alp.config import Config, InputError, RolloutConfig, TIRConfig
from megatron_alp.diagnostics.figures import probability_scatter
from megatron_alp.diagnostics.layer_divergence import KINDS, draw_layers, format_layers, layer_divergence
from megatron_alp.diagnostics.mismatch_report import describe, draw_envelope, engine_settings, mismatch_report
from megatron_alp.plan.shape import RunShape
from megatron_alp.resolve import load_config
from megatron_alp.rollout import DistributedRollout
from megatron_alp.rollout.base import get_engine
from megatron_alp.runtime.console import held_warnings, say
from megatron_alp.training.calibration import SIZES, calibrate_sigma, input_divergence, probe_sequences, site_layers
from megatron_alp.training.layer_states import megatron_layer_states
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.perturbation import sigma_stats
from megatron_alp.training.policy_update import compute_logprobs
from megatron_alp.training.rl_batch import build_rl_batch

SCATTER_POINTS = 20000


def measure(cfg: Config, model_dir: str, *, prompts: int, n: Optional[int], max_tokens: Optional[int],
            seed: int, layers: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Sample the probe with the config's engine, score it with the Megatron model; returns the
    report (:func:`~megatron_alp.diagnostics.mismatch_report.mismatch_report` plus what was measured,
    with ``layers``: the per-layer divergence on that many samples) and the flat train and rollout
    logprobs."""
    s = cfg.rollout.sampling
    n = n or s.n
    per_layer = RunShape.of(cfg).layer_probe
    max_tokens = min(max_tokens or s.max_response_length, s.max_response_length)
    split = "val" if cfg.data.val_files else "train"
    # The engine's context follows the probe's response budget, as the trainer's follows its own.
    probe = s.model_copy(update={"n": n, "max_response_length": max_tokens})
    rollout_cfg = cfg.rollout.model_copy(update={"sampling": probe})
    params = rollout_params(probe, seed if seeds_samples(s) else None)
    with Session(cfg, model_dir, seed=seed) as session:
        data = session.prompts(split, head=prompts)
        # the config's ALP sites (the unperturbed passes never see them) for the sigma calibration below
        model = session.scorer(cfg.model.load or model_dir, perturbation=cfg.perturbation)
        engine = session.engine(rollout_cfg)
        if cfg.model.load is not None:
            session.sync_weights(model)
        t0 = time.time()
        trajectories = sample(engine, [p.prompt_ids for p in data], params, TIRConfig())
        seconds = time.time() - t0
        # every token that was fed through the models (the last one is only a target)
        sequences = [(t.prompt_ids + t.response_ids)[:-1] for t in trajectories[:layers]]
        engine_states = engine_layer_states(engine, sequences, KINDS) if layers else None
        # perturbation.calibration_mode: per_layer(_added) sizes sigma by each layer's drift
        probe = probe_sequences([t.prompt_ids + t.response_ids for t in trajectories]) if per_layer else []
        probe_states = engine_layer_states(engine, probe, ("input",)) if probe else None
        session.close_engine()
        layer_report = layer_divergence(engine_states, megatron_layer_states(model, sequences, KINDS)) if layers else None
        divergence = probe_divergence(model, probe, probe_states, cfg.perturbation.calibration_mode) if probe else None
        del engine_states, probe_states  # [layers, tokens, hidden] per kind and sequence: not kept for the scoring
        batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), session.pad_id)
        logprob_pass = dict(batching=Batching.for_logprobs(cfg.trainer), temperature=s.temperature,
                            pad_id=session.pad_id, fused=cfg.trainer.fused_linear_logprobs)
        train_lp = compute_logprobs(model, batch, **logprob_pass)
        calibration = None
        if cfg.perturbation.enabled:
            batch.old_logprobs = train_lp
            calibration = calibrate_sigma(model, batch, cfg.perturbation, iteration=0, divergence=divergence,
                                          **logprob_pass)
            calibration["sigma"] = {k.split("/")[1]: v for k, v in sigma_stats(model).items() if k.endswith("/mean")}
            if divergence is not None:
                calibration["input_divergence"] = dict(zip(calibration["sigma"], divergence))
    keep = batch.loss_mask > 0
    first = torch.tensor([len(t.prompt_ids) - 1 for t in trajectories])  # column of each response's first target
    positions = (torch.arange(batch.tokens.shape[1]).unsqueeze(0) - first.unsqueeze(1))[keep]
    train, rollout = train_lp[keep], batch.rollout_logprobs[keep]
    report = {
        "model": str(model_dir),
        "checkpoint": cfg.model.load,
        "train_dtype": cfg.model.dtype,
        "engine": engine_settings(cfg),
        "sampling": {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "max_tokens": max_tokens, "seed": params.seed},
        "prompt_files": list(cfg.data.val_files or cfg.data.train_files),
        "prompts": len(data),
        "samples": len(trajectories),
        "generation_s": seconds,
        "tokens_per_s": int(keep.sum()) / max(seconds, 1e-9),
        **mismatch_report(train, rollout, positions, max_tokens),
        "calibration": calibration,
        "layers": layer_report,
    }
    return report, train, rollout


def probe_divergence(model, probe: list[list[int]], engine: list[dict], mode: str) -> list[float]:
    """Per perturbed site, the drift the calibration's per-layer ``mode`` sizes its sigma by: of the
    layer's input (``per_layer``), or added since the site before (``per_layer_added``: the sites run
    on the engine's inputs)."""
    sites = site_layers(model)
    fed = [e["input"] for e in engine] if mode == "per_layer_added" else None
    return input_divergence(engine, megatron_layer_states(model, probe, ("input",), fed=fed, at=tuple(sites)), sites)


def engine_layer_states(rollout: DistributedRollout, sequences: list[list[int]], kinds: tuple[str, ...]) -> list[dict]:
    """The engine's per-layer hidden states of ``sequences``, only ``kinds``, captured inside it (vLLM only)."""
    if not get_engine(rollout.cfg.engine).captures_layers:
        raise InputError(f"--layers: rollout.engine {rollout.cfg.engine} cannot show its layers' hidden states; "
                         "use rollout.engine vllm")
    return rollout.layer_states(sequences, kinds)


def setting_name(cfg: Config) -> str:
    """Folder name of the compared settings (``train-float32_vllm-bfloat16-fp8_per_channel``), so
    the reports of several settings sit side by side under ``RUN/mismatch``."""
    r: RolloutConfig = cfg.rollout
    engine = [r.engine, r.dtype] + [r.quantization] * (r.quantization != "none")
    engine += [f"kv_{r.kv_cache_dtype}"] * (r.kv_cache_dtype != "auto")
    engine += [f"tp{r.tensor_parallel_size}"] * (r.tensor_parallel_size > 1)
    return f"train-{cfg.model.dtype}_{'-'.join(engine)}"


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


def draw_figure(report: dict, train: torch.Tensor, rollout: torch.Tensor, path: Path) -> None:
    """Left: P2-P98 and P25-P75 of log r with the median, per engine-probability bucket (the
    paper's conditional envelope). Right: training vs rollout probability of every token (a seeded
    subsample beyond ``SCATTER_POINTS``), as ``megatron-alp plot``'s scatter."""
    fig = Figure(figsize=(12, 4.8))
    env, sc = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1]})
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


def draw_layer_figure(report: dict, path: Path) -> None:
    """Relative hidden-state divergence per layer (log y): the residual stream, attention and MLP."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    draw_layers(ax, report["layers"])
    ax.set_title(f"{describe(report)}: per-layer divergence ({report['layers']['sequences']} sequences, "
                 f"{report['layers']['tokens']} tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def add_arguments(parser) -> None:
    parser.add_argument("config", help="run config (YAML); its model, rollout and data sections are used")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. rollout.dtype=float32 "
                             "rollout.quantization=fp8_per_channel")
    parser.add_argument("--model", metavar="DIR",
                        help="Hugging Face model directory (default: model.hf_path, else the run's base_model under "
                             "trainer.output_dir)")
    parser.add_argument("--prompts", type=positive, default=64, metavar="N",
                        help="probe the first N prompts of data.val_files, else data.train_files (default: 64)")
    parser.add_argument("--n", type=positive, metavar="N", help="samples per prompt (default: rollout.sampling.n)")
    parser.add_argument("--max-tokens", type=positive, metavar="N",
                        help="response length cap (default and upper bound: rollout.sampling.max_response_length)")
    parser.add_argument("--seed", type=int, metavar="S", help="engine and sampling seed (default: trainer.seed)")
    parser.add_argument("--layers", type=positive, default=0, metavar="N",
                        help="also compare the hidden states of every decoder layer, engine vs Megatron, on the "
                             "first N samples (vLLM; on GPUs with rollout.enforce_eager=true): 'layers' in "
                             "mismatch.json and layers.png (default: off)")
    parser.add_argument("--out", metavar="DIR",
                        help="output folder for mismatch.json, mismatch.png and engine.log "
                             "(default: <trainer.output_dir>/mismatch/train-<model.dtype>_<engine settings>)")


def run(args) -> int:
    refuse_torchrun("mismatch")
    # Validation imports the engines and Megatron-Core: their import-time warnings go to the log.
    with held_warnings():
        cfg = load_config(args.config, args.overrides)
    model = str(model_dir(cfg, args.model))
    seed = cfg.trainer.seed if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "mismatch" / setting_name(cfg)
    with library_log(out / "engine.log", "mismatch"):
        report, train, rollout = measure(cfg, model, prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
                                         seed=seed, layers=args.layers)
        draw_figure(report, train, rollout, out / "mismatch.png")
        if report["layers"]:
            draw_layer_figure(report, out / "layers.png")
    write_json(out / "mismatch.json", report)
    say(f"{describe(report)}: {report['prompts']} prompts x {report['sampling']['n']} samples, "
        f"{report['all']['tokens']} tokens ({report['tokens_per_s']:.0f} tokens/s)")
    say(format_table(report))
    cal = report["calibration"]
    if cal:
        sigmas = ", ".join(f"{k} {v:.3g}" for k, v in cal["sigma"].items())
        size = SIZES[cfg.perturbation.calibration_mode]
        say(f"perturbation.init_std: auto would set sigma = {cal['calibration/scale']:.3g} x {size} ({sigmas}): "
            f"KL(train || perturbed) {cal['calibration/perturbed_kl']:.3g} for a target of "
            f"{cal['calibration/target_kl']:.3g} (perturbation.calibration_target x the k3 KL above)")
    written = [out / "mismatch.json", out / "mismatch.png"]
    if report["layers"]:
        jump = report["layers"]["jump"]
        say(f"hidden-state divergence ||h_engine - h_train|| / ||h_train|| per layer "
            f"({report['layers']['tokens']} tokens of {report['layers']['sequences']} samples)"
            + (f", largest growth at layer {jump['layer']}:" if jump["layer"] is not None else ":"))
        say(format_layers(report["layers"]))
        written.append(out / "layers.png")
    say(f"written: {', '.join(map(str, written))}")
    return 0
