"""The paper's diagnostic figures of a run, from its ``metrics.jsonl`` and ``token_probs/`` dumps
(``megatron-alp plot``, and the trainer whenever a checkpoint lands).

Figures (PNG, in ``RUN_DIR/plots`` or ``--out``), over iterations: reward (of the training
rollouts, and on the validation set when ``trainer.eval_interval`` logged it, from the base model
on), the importance-ratio envelope (P2-P98 and P5-P95 bands around the median), train-rollout
mismatch (KL k3 and chi-square; KL k1, which can be negative, apart), entropy, gradient norm, sigma
per perturbed layer, the train-vs-rollout token-probability scatter with Pearson r, and
``overview.png`` with all curves.
Several run directories are overlaid (e.g. ALP against Seq-Bypass), one colour per run. Metrics
a run did not log are skipped with a note.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Optional

import matplotlib
import numpy as np
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from megatron_alp.runtime.run_log import METRICS_FILE, read_metrics

_SIGMA_SITE = re.compile(r"^sigma/(layer_(\d+)|logits)/mean$")

# name -> (title, y label, [(metric key, line label)], log scale); "{k}" is the run's eval.k
CURVES = {
    "reward": ("Reward", "mean reward", [("reward/mean", "train (rollouts)"),
                                         ("val/reward_mean", "validation (average@{k})")], False),
    "mismatch_kl": ("Train-rollout mismatch", "divergence",
                    [("mismatch/kl_k3", "KL (k3)"), ("mismatch/chi2", "chi-square")], True),
    "mismatch_k1": ("Train-rollout mismatch: KL k1", "KL (k1), may be negative", [("mismatch/kl_k1", "KL (k1)")],
                    False),
    "entropy": ("Entropy", "mean token entropy", [("entropy/mean", "entropy")], False),
    "grad_norm": ("Gradient norm", "global grad norm", [("grad_norm", "grad norm")], True),
    "response_length": ("Response length", "tokens", [("response_length/mean", "mean length")], False),
}
X_LABEL = "iteration"
X_LABEL_WITH_VALIDATION = "iteration (validation: after that many; 0: the base model)"


class Run:
    """One run directory's metrics as columns over iterations. A record describes its iteration
    (the rollouts of the policy after that many updates); validation (``val/*``) ran after it, so
    it is drawn at iteration + 1: the base model's (iteration -1) at 0."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.name = self.dir.resolve().name
        path = self.dir / METRICS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (is {self.dir} a megatron-alp run directory?)")
        self.records, self.bad_lines = read_metrics(path)
        if not self.records:
            raise ValueError(f"{path} has no metric records")
        self.iterations = len({r["iteration"] for r in self.records if r.get("iteration", -1) >= 0})
        config = self.dir / "config.yaml"
        self.k = (yaml.safe_load(config.read_text()) or {}).get("eval", {}).get("k", "k") if config.is_file() else "k"

    def series(self, key: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(x, y) of the records with a finite ``key``; None when no record has it."""
        shift = 1 if key.startswith("val/") else 0
        pts = [(r["iteration"] + shift, r[key]) for r in self.records
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "iteration" in r]
        if not pts:
            return None
        x, y = zip(*pts)
        return np.asarray(x, dtype=float), np.asarray(y, dtype=float)

    def sigma_sites(self) -> list[str]:
        """Perturbation sites with sigma logged: ``layer_00``, ..., then ``logits``."""
        sites = {m.group(1) for r in self.records for k in r if (m := _SIGMA_SITE.match(k))}
        return sorted(sites, key=lambda s: (s == "logits", s))

    def token_prob_file(self, iteration: Optional[int]) -> Optional[Path]:
        folder = self.dir / "token_probs"
        if iteration is not None:
            path = folder / f"iter_{iteration:06d}.npz"
            return path if path.is_file() else None
        files = sorted(folder.glob("iter_*.npz")) if folder.is_dir() else []
        return files[-1] if files else None


def pearson_r(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


# ------------------------------------------------------------------------------------ panels


def _colors(n: int) -> list:
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def _finish(ax, title: str, ylabel: str, log: bool = False) -> None:
    ax.set_title(title)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(ylabel)
    if log:
        _plain_log_axis(ax)
    ax.grid(True, alpha=0.3)


def _plain_log_axis(ax) -> None:
    """A log y axis where the data span a decade or more, labelled 0.5, 1, 2 rather than 5x10^-1
    (ratios and sigmas read better); a narrower span keeps the linear axis, whose ticks a log
    axis would thin to one."""
    lo, hi = ax.dataLim.y0, ax.dataLim.y1  # the data's range, not the axis margins
    if lo <= 0 or hi / lo < 10:
        return
    ax.set_yscale("log")
    if hi / lo > 1e3:  # many decades: the default 10^k labels are clearer
        return

    def label(v, _pos, minor):
        lead = round(v / 10 ** math.floor(math.log10(v)), 6)
        return f"{v:g}" if not minor or lead in (2, 3, 5) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, p: label(v, p, False)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, p: label(v, p, True)))


def draw_curve(ax, runs: list[Run], name: str) -> bool:
    """One metric family over steps; log scale (if asked) only when every value is positive."""
    title, ylabel, keys, log = CURVES[name]
    all_positive = True
    drawn = False
    for run, color in zip(runs, _colors(len(runs))):
        for (key, label), style in zip(keys, ("-", "--", ":")):
            s = run.series(key)
            if s is None:
                continue
            parts = [run.name] * (len(runs) > 1) + [label.format(k=run.k)] * (len(keys) > 1)
            sparse = len(s[0]) < run.iterations  # e.g. validation every few iterations: mark its points
            ax.plot(*s, style, color=color, label=" / ".join(parts) or None, lw=1.5, marker="o" if sparse else None,
                    ms=4)
            all_positive &= bool(np.all(s[1] > 0))
            drawn = True
    if drawn:
        _finish(ax, title, ylabel, log and all_positive)
        if any(key.startswith("val/") and run.series(key) is not None for key, _ in keys for run in runs):
            ax.set_xlabel(X_LABEL_WITH_VALIDATION)
        if len(runs) > 1 or len(keys) > 1:
            ax.legend(fontsize=8)
    return drawn


def draw_ratio_envelope(ax, runs: list[Run]) -> bool:
    """The paper's ratio-quantile envelope: P2-P98 (light) and P5-P95 (dark) bands, median line."""
    drawn, all_positive = False, True
    for run, color in zip(runs, _colors(len(runs))):
        lo, hi = run.series("ratio/p2"), run.series("ratio/p98")
        if lo is None or hi is None:
            continue
        all_positive &= bool(np.all(lo[1] > 0))
        x = np.intersect1d(lo[0], hi[0])
        label = f"{run.name} " if len(runs) > 1 else ""
        ax.fill_between(x, _at(lo, x), _at(hi, x), color=color, alpha=0.2, label=f"{label}P2-P98")
        p5, p95 = run.series("ratio/p5"), run.series("ratio/p95")
        if p5 is not None and p95 is not None:
            x5 = np.intersect1d(p5[0], p95[0])
            ax.fill_between(x5, _at(p5, x5), _at(p95, x5), color=color, alpha=0.35, label=f"{label}P5-P95")
        med = run.series("ratio/p50")
        if med is not None:
            ax.plot(*med, color=color, lw=1.2, label=f"{label}median")
        drawn = True
    if drawn:
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        _finish(ax, "Importance-ratio envelope", "ratio (train / rollout)", log=all_positive)
        ax.legend(fontsize=8)
    return drawn


def _at(series: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    lookup = dict(zip(series[0].tolist(), series[1].tolist()))
    return np.asarray([lookup[v] for v in x.tolist()])


def draw_sigma(ax, run: Run, title_prefix: str = "") -> bool:
    """Mean sigma of every perturbed site over time, coloured from the first layer to the last;
    every line in the legend (in columns when there are many)."""
    sites = run.sigma_sites()
    if not sites:
        return False
    layers = [s for s in sites if s != "logits"]
    cmap = matplotlib.colormaps["viridis"]
    for i, site in enumerate(layers):
        ax.plot(*run.series(f"sigma/{site}/mean"), color=cmap(i / max(len(layers) - 1, 1)), lw=1.0,
                label=f"layer {int(site.split('_')[1])}")
    if "logits" in sites:
        ax.plot(*run.series("sigma/logits/mean"), color="crimson", lw=1.5, ls="--", label="logits")
    _finish(ax, f"{title_prefix}Sigma per layer", "sigma (mean over dims)", log=True)
    ax.legend(fontsize=7, ncol=max(1, len(sites) // 8))
    return True


def probability_scatter(ax, train: np.ndarray, rollout: np.ndarray, max_points: int = 20000, size: float = 2.0,
                        alpha: float = 0.3) -> None:
    """Training vs rollout-engine probability of the same tokens (a fixed subsample of at most
    ``max_points``), against the diagonal where the two policies agree."""
    if len(train) > max_points:
        idx = np.random.default_rng(0).choice(len(train), max_points, replace=False)
        train, rollout = train[idx], rollout[idx]
    ax.plot([0, 1], [0, 1], color="grey", lw=0.6, ls=":", zorder=1)  # behind the points it would hide
    ax.scatter(rollout, train, s=size, alpha=alpha, lw=0, color="tab:blue", rasterized=True, zorder=2)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("rollout-engine probability")
    ax.set_ylabel("training probability")
    ax.grid(True, alpha=0.3)


def draw_scatter(ax, path: Path, title_prefix: str = "", max_points: int = 20000) -> float:
    """Train vs rollout token probability of one iteration; returns Pearson r."""
    with np.load(path) as d:
        train, rollout = np.asarray(d["train_prob"], dtype=float), np.asarray(d["rollout_prob"], dtype=float)
    if train.shape != rollout.shape:
        raise ValueError(f"{path}: train_prob {train.shape} and rollout_prob {rollout.shape} differ in shape")
    r = pearson_r(train, rollout)
    probability_scatter(ax, train, rollout, max_points)
    it = int(path.stem.split("_")[-1])
    ax.set_title(f"{title_prefix}Token probabilities, iteration {it}\nPearson r = {r:.4f} (n = {len(train)})")
    return r


# ---------------------------------------------------------------------------------- figures


def _save(fig, path: Path) -> None:
    """Atomic PNG write: a viewer never sees half a file."""
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)


def make_plots(run_dirs: list[str | Path], out_dir: Optional[str | Path] = None,
               iteration: Optional[int] = None, log=print) -> dict[str, Path]:
    """Write every figure the runs' metrics allow; returns {figure name: path}."""
    runs = [Run(d) for d in run_dirs]
    out = Path(out_dir) if out_dir else runs[0].dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if run.bad_lines:
            log(f"note: {run.dir / METRICS_FILE}: skipped {run.bad_lines} unreadable line(s)")
    written: dict[str, Path] = {}

    def single(name: str, draw, *args, size=(6, 4)) -> bool:
        fig = Figure(figsize=size)
        ok = draw(fig.subplots(), *args)
        if ok is not False:
            written[name] = out / f"{name}.png"
            _save(fig, written[name])
        return ok is not False

    panels = []
    for name in ("reward", "ratio_envelope", "mismatch_kl", "mismatch_k1", "entropy", "grad_norm", "response_length"):
        if name == "ratio_envelope":
            ok, needs = single(name, draw_ratio_envelope, runs), ["ratio/p2", "ratio/p98"]
        else:
            ok, needs = single(name, draw_curve, runs, name), [k for k, _ in CURVES[name][2]]
        if ok:
            panels.append((name, None))
        else:
            log(f"note: skipped {name}.png (no {' / '.join(needs)} in the metrics)")
    for run in runs:
        suffix = f"_{run.name}" if len(runs) > 1 else ""
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        if single(f"sigma_layers{suffix}", draw_sigma, run, prefix):
            panels.append(("sigma", run))
        else:
            log(f"note: skipped sigma_layers{suffix}.png ({run.name} logged no sigma/layer_XX/mean: "
                "perturbation off?)")
        path = run.token_prob_file(iteration)
        if path is None:
            which = f"iteration {iteration}" if iteration is not None else "any iteration"
            log(f"note: skipped token_prob_scatter{suffix}.png (no token_probs/iter_*.npz for {which} in {run.dir})")
        else:
            single(f"token_prob_scatter{suffix}", draw_scatter, path, prefix, size=(5, 5))
            panels.append(("scatter", (path, prefix)))
    if panels:
        cols = 3
        rows = math.ceil(len(panels) / cols)
        fig = Figure(figsize=(5.5 * cols, 3.8 * rows))
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, (kind, arg) in zip(axes.flat, panels):
            if kind == "ratio_envelope":
                draw_ratio_envelope(ax, runs)
            elif kind == "sigma":
                draw_sigma(ax, arg, f"{arg.name}: " if len(runs) > 1 else "")
            elif kind == "scatter":
                draw_scatter(ax, *arg)
            else:
                draw_curve(ax, runs, kind)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(" vs ".join(r.name for r in runs))
        fig.tight_layout()
        written["overview"] = out / "overview.png"
        _save(fig, written["overview"])
    return written
