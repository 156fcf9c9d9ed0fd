"""`megatron-alp eval`: average@k and pass@k on math benchmarks.

Each problem gets ``k`` samples from the rollout engine (vLLM or SGLang, as configured); each
sample is scored by the configured reward (math-verify on the final ``\\boxed{}`` answer).
average@k is the mean accuracy over all samples (the paper reports average@32 at temperature 1.0
with a 4096-token limit); pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) of
Chen et al. (2021) with n = k samples and c of them correct, so pass@j for every j <= k comes
from the same samples.

Benchmark files keep their published column layouts, detected from the columns: Math500 and
AIME (``problem``/``answer``, any capitalisation), Minerva (``problem`` + a ``solution`` with a
boxed answer), OlympiadBench (``question`` + ``final_answer`` list), ``question``/``answer``, and
the training format (``prompt`` + ``reward_model.ground_truth``). Models are Hugging Face
directories: convert a Megatron checkpoint with ``megatron-alp convert`` first.

Training validates with the same sampling and scoring (:class:`Validation`,
``trainer.eval_interval``), through the run's own engine instead of a new one.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from megatron_alp.config import Config, ConfigError, EvalConfig, config_from_dict, load_config
from megatron_alp.data import (
    DataError,
    Prompt,
    SkipRow,
    build_messages,
    get_path,
    load_tokenizer,
    make_prompt,
    normalize_answer,
    read_rows,
)
from megatron_alp.rewards.math_verify import extract_boxed
from megatron_alp.tir.multi_turn import sample_trajectories

# ------------------------------------------------------------------------------- estimators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed as a
    product so it stays exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def score_matrix(correct: np.ndarray, pass_k: list[int]) -> dict:
    """average@n and pass@k (k <= n) of a (problems x samples) boolean matrix."""
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 2 or correct.shape[0] == 0 or correct.shape[1] == 0:
        raise ValueError(f"expected a non-empty (problems x samples) matrix, got shape {correct.shape}")
    n = correct.shape[1]
    counts = correct.sum(axis=1)
    ks = [k for k in pass_k if k <= n]
    return {
        "problems": int(correct.shape[0]),
        "samples": n,
        f"average@{n}": float(correct.mean()),
        "pass@k": {str(k): float(np.mean([pass_at_k(n, int(c), k) for c in counts])) for k in ks},
    }


# ---------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """A benchmark's columns: where the question is and how to get the ground truth."""

    name: str
    benchmarks: str
    question: str
    answer: Optional[str] = None  # column with the answer (str, number or list)
    solution: Optional[str] = None  # else: column whose last \boxed{} is the answer

    def columns(self) -> list[str]:
        return [c for c in (self.question, self.answer, self.solution) if c]


LAYOUTS = (
    Layout("olympiadbench", "OlympiadBench", question="question", answer="final_answer"),
    Layout("problem_answer", "Math500, AIME24/25, Minerva with answers", question="problem", answer="answer"),
    Layout("minerva", "Minerva Math", question="problem", solution="solution"),
    Layout("question_answer", "question/answer files", question="question", answer="answer"),
)


def _lookup(columns: set[str], name: str) -> Optional[str]:
    """The actual column matching ``name`` case-insensitively (AIME files use Problem/Answer)."""
    for c in columns:
        if c.lower() == name.lower():
            return c
    return None


def detect_layout(columns: set[str], prompt_key: str, answer_key: str) -> tuple[str, Callable[[dict], tuple]]:
    """(layout name, row -> (question or messages, ground truth)) for a file's columns."""
    if prompt_key.split(".")[0] in columns and answer_key.split(".")[0] in columns:
        return "verl", lambda r: (get_path(r, prompt_key, None), get_path(r, answer_key, None))
    for lay in LAYOUTS:
        actual = {c: _lookup(columns, c) for c in lay.columns()}
        if all(actual.values()):
            q, a, s = actual[lay.question], actual.get(lay.answer), actual.get(lay.solution)
            if a:
                return lay.name, lambda r, q=q, a=a: (r.get(q), r.get(a))
            return lay.name, lambda r, q=q, s=s: (r.get(q), extract_boxed(str(r.get(s) or "")))
    known = "; ".join(f"{lay.benchmarks}: {', '.join(lay.columns())}" for lay in LAYOUTS)
    raise DataError(
        f"unknown benchmark layout with columns {sorted(columns)}; expected one of: {known}; "
        f"or the training format ({prompt_key}, {answer_key})"
    )


@dataclass
class Benchmark:
    name: str
    path: str
    layout: str
    prompts: list[Prompt]
    skipped: dict


def load_benchmark(name: str, path: str, tokenizer, cfg: Config, limit: Optional[int] = None) -> Benchmark:
    skipped: Counter = Counter()
    rows = read_rows(path, skipped)
    if not rows:
        raise DataError(f"benchmark file {path} has no rows")
    columns = {k for r in rows for k in r}
    layout, extract = detect_layout(columns, cfg.data.prompt_key, cfg.data.answer_key)
    prompts = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        try:
            question, answer = extract(row)
            messages = build_messages(question, cfg.data.system_prompt, cfg.data.replace_system_prompt)
            prompts.append(make_prompt(tokenizer, messages, normalize_answer(answer), f"{path}:{i}",
                                       cfg.rollout.sampling.max_prompt_length))
        except SkipRow as s:
            skipped[s.reason] += 1
    if not prompts:
        raise DataError(f"benchmark {name} ({path}): no usable problems (skipped by reason: {dict(skipped)})")
    return Benchmark(name, str(path), layout, prompts, dict(skipped))


def parse_file_arg(item: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after the file: ``aime24.jsonl`` -> ``aime24``)."""
    if "=" in item and not Path(item).exists():
        name, path = item.split("=", 1)
        return name.strip(), path.strip()
    return Path(item).name.split(".")[0].lower(), item


# ------------------------------------------------------------------------------------- run


def response_budget(ev: EvalConfig, context: int, longest_prompt: int, log=print) -> int:
    """``eval.max_response_length`` cut to what a ``context``-token engine leaves after the
    longest prompt, with a one-line notice when it is cut."""
    room = context - longest_prompt
    if room <= 0:
        raise ConfigError(f"the engine context of {context} tokens leaves no room to answer a "
                          f"{longest_prompt}-token prompt (rollout.max_model_len, the model's max_position_embeddings)")
    if ev.max_response_length > room:
        log(f"eval: responses limited to {room} tokens (eval.max_response_length={ev.max_response_length}): "
            f"the engine context is {context} tokens and the longest prompt has {longest_prompt}")
    return min(ev.max_response_length, room)


def generate(cfg: Config, model_dir: str, prompts: list[Prompt], seed: int):
    """Texts (len(prompts) * k, grouped by prompt) and response lengths, from the rollout engine.
    The engine context is prompt + ``eval.max_response_length``, at most the model's
    ``max_position_embeddings``; an explicit ``rollout.max_model_len`` is taken as the context."""
    from megatron_alp.models.families import load_hf_config
    from megatron_alp.rollout import build_engine
    from megatron_alp.rollout.base import SamplingParams

    ev = cfg.eval
    longest = max(len(p.prompt_ids) for p in prompts)
    wanted = longest + ev.max_response_length
    positions = int(load_hf_config(model_dir).get("max_position_embeddings", wanted))
    if cfg.rollout.max_model_len and cfg.rollout.max_model_len > positions:
        raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                          f"max_position_embeddings={positions}")
    context = cfg.rollout.max_model_len or min(wanted, positions)
    max_tokens = response_budget(ev, context, longest)
    sampling = cfg.rollout.sampling.model_copy(
        update=dict(n=ev.k, temperature=ev.temperature, top_p=ev.top_p, top_k=-1, max_response_length=max_tokens))
    rollout_cfg = cfg.rollout.model_copy(update=dict(sampling=sampling, max_model_len=context))
    params = SamplingParams(n=ev.k, temperature=ev.temperature, top_p=ev.top_p, max_tokens=max_tokens)
    engine = build_engine(rollout_cfg, model_dir, seed)
    try:
        ids = [p.prompt_ids for p in prompts]
        if cfg.tir.enabled:
            from megatron_alp.tir.sandbox import SandboxExecutor

            with SandboxExecutor(cfg.tir.sandbox) as executor:
                trajs = sample_trajectories(engine, ids, params, cfg.tir, load_tokenizer(model_dir), executor)
        else:
            trajs = sample_trajectories(engine, ids, params, cfg.tir)
        return [t.response_text for t in trajs], [len(t.response_ids) for t in trajs]
    finally:
        engine.shutdown()


def evaluate(cfg: Config, model_dir: str, files: list[tuple[str, str]], *, seed: int,
             limit: Optional[int] = None, samples_path: Optional[Path] = None) -> dict:
    """Score ``model_dir`` on each (name, path) benchmark; returns the results dict."""
    from megatron_alp.rewards import build_reward

    if not files:
        raise ConfigError("no benchmark files: set eval.files or data.val_files in the config, or pass --files")
    names = [name for name, _ in files]
    if len(set(names)) != len(names):
        raise ConfigError(f"benchmark names must differ (got {names}): name files as NAME=PATH")
    tokenizer = load_tokenizer(model_dir)
    benches = [load_benchmark(name, path, tokenizer, cfg, limit) for name, path in files]
    prompts = [p for b in benches for p in b.prompts]
    t0 = time.time()
    texts, lengths = generate(cfg, model_dir, prompts, seed)
    gen_s = time.time() - t0
    truths = [p.ground_truth for p in prompts for _ in range(cfg.eval.k)]
    rewards = build_reward(cfg.reward)(texts, truths)
    results, records = summarize(benches, texts, lengths, rewards, cfg.eval)
    results.update(model=str(model_dir), seed=seed, generation_s=gen_s)
    if samples_path is not None:
        _write_atomic(samples_path, "".join(json.dumps(r) + "\n" for r in records))
    return results


def summarize(benches: list[Benchmark], texts: list[str], lengths: list[int], rewards, ev) -> tuple[dict, list[dict]]:
    """Per-benchmark and averaged scores, and one record per sample, from the samples (grouped
    by prompt, ``ev.k`` each, benchmarks in order) and their rewards."""
    k = ev.k
    rewards = np.asarray(rewards, dtype=np.float64)
    total = sum(len(b.prompts) for b in benches) * k
    if not len(texts) == len(lengths) == len(rewards) == total:
        raise ValueError(f"expected {total} samples, got {len(texts)} texts, {len(lengths)} lengths, "
                         f"{len(rewards)} rewards")
    correct = rewards > ev.correct_threshold
    results = {"k": k, "temperature": ev.temperature, "max_response_length": ev.max_response_length,
               "benchmarks": {}}
    records = []
    start = 0
    for b in benches:
        end = start + len(b.prompts) * k
        stats = score_matrix(correct[start:end].reshape(len(b.prompts), k), ev.pass_k)
        stats.update(file=b.path, layout=b.layout, skipped=b.skipped,
                     mean_response_length=float(np.mean(lengths[start:end])))
        results["benchmarks"][b.name] = stats
        for j in range(start, end):
            p = b.prompts[(j - start) // k]
            records.append({"benchmark": b.name, "source": p.source, "sample": (j - start) % k,
                            "ground_truth": p.ground_truth, "reward": float(rewards[j]),
                            "correct": bool(correct[j]), "response": texts[j]})
        start = end
    per = list(results["benchmarks"].values())
    avg_key = f"average@{k}"
    results["average"] = {  # macro average over benchmarks, as the paper's "Average" column
        avg_key: float(np.mean([s[avg_key] for s in per])),
        "pass@k": {j: float(np.mean([s["pass@k"][j] for s in per])) for j in per[0]["pass@k"]},
    }
    return results, records


def validation_metrics(results: dict) -> dict:
    """Flat ``val/*`` metrics of :func:`summarize`'s results: ``val/reward_mean`` (average@k) and
    ``val/pass@j`` over all files (their macro average), and ``val/<file>/...`` when there are several."""
    k = results["k"]
    scopes = [("val", results["average"])]
    if len(results["benchmarks"]) > 1:
        scopes += [(f"val/{name}", stats) for name, stats in results["benchmarks"].items()]
    out = {}
    for prefix, stats in scopes:
        out[f"{prefix}/reward_mean"] = stats[f"average@{k}"]
        out.update({f"{prefix}/pass@{j}": v for j, v in stats["pass@k"].items()})
    return out


class Validation:
    """``data.val_files`` scored during training (``trainer.eval_interval``) by the run's own
    engine, hence with the policy of the latest weight sync and never perturbed: ``eval.k`` samples
    per problem at ``eval.temperature`` and ``eval.top_p``, at most ``eval.max_response_length``
    tokens (cut to the engine context). Every rank calls :meth:`run` (the rollout API is collective)."""

    def __init__(self, cfg: Config, tokenizer, context: int, log=print):
        if not cfg.data.val_files:
            raise ConfigError("trainer.eval_interval needs data.val_files (the validation prompt files)")
        files = [(Path(f).name.split(".")[0], f) for f in cfg.data.val_files]
        if len({name for name, _ in files}) < len(files):  # e.g. a/val.jsonl and b/val.jsonl
            files = [(f, f) for _, f in files]
        self.cfg = cfg
        self.benches = [load_benchmark(name, path, tokenizer, cfg) for name, path in files]
        for b in self.benches:
            if b.skipped:
                log(f"validation: {b.path}: skipped rows {b.skipped}")
        self.prompts = [p for b in self.benches for p in b.prompts]
        self.max_tokens = response_budget(cfg.eval, context, max(len(p.prompt_ids) for p in self.prompts), log)

    def run(self, rollout, *, seed: Optional[int], reward_fn, tokenizer, executor=None, broadcast=None) -> dict:
        """``val/*`` metrics (:func:`validation_metrics`) on the rank holding ``reward_fn``, {} on
        the others. ``seed`` seeds the samples (:class:`~megatron_alp.rollout.base.SamplingParams`):
        the same seed at every evaluation makes successive scores differ by the policy, not the draw."""
        from megatron_alp.rollout.base import SamplingParams

        ev = self.cfg.eval
        params = SamplingParams(n=ev.k, temperature=ev.temperature, top_p=ev.top_p, max_tokens=self.max_tokens,
                                seed=seed)
        trajs = sample_trajectories(rollout, [p.prompt_ids for p in self.prompts], params, self.cfg.tir,
                                    tokenizer, executor, broadcast)
        if reward_fn is None:
            return {}
        texts = [t.response_text for t in trajs]
        rewards = reward_fn(texts, [p.ground_truth for p in self.prompts for _ in range(ev.k)])
        results, _ = summarize(self.benches, texts, [len(t.response_ids) for t in trajs], rewards, ev)
        return validation_metrics(results)


def format_table(results: dict, show_k: Optional[list[int]] = None) -> str:
    k = results["k"]
    avg_key = f"average@{k}"
    rows = [(name, s) for name, s in results["benchmarks"].items()] + [("Average", results["average"])]
    ks = [j for j in results["average"]["pass@k"] if show_k is None or int(j) in show_k]
    header = ["benchmark", "problems", avg_key] + [f"pass@{j}" for j in ks]
    lines = [header]
    for name, s in rows:
        lines.append([name, str(s.get("problems", "")), f"{100 * s[avg_key]:.2f}"]
                     + [f"{100 * s['pass@k'][j]:.2f}" for j in ks])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in lines)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve_model(cfg: Config, model: Optional[str]) -> str:
    """--model, else model.hf_path, else a tiny run's base model under trainer.output_dir."""
    if model:
        path = Path(model)
    elif cfg.model.hf_path:
        path = Path(cfg.model.hf_path)
    else:
        path = Path(cfg.trainer.output_dir) / "base_model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {path} has no config.json: pass --model with a Hugging Face model directory "
            "(convert Megatron checkpoints with `megatron-alp convert`)")
    return str(path)


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?",
                        help="run config (YAML); its rollout, reward, data and eval sections are used")
    parser.add_argument("--model", help="Hugging Face model directory (default: model.hf_path of the config)")
    parser.add_argument("--files", nargs="+",
                        help="benchmark files, PATH or NAME=PATH (default: eval.files, else data.val_files)")
    parser.add_argument("--k", type=int, help="samples per problem (default: eval.k)")
    parser.add_argument("--limit", type=int, help="only the first N problems of each file (smoke runs)")
    parser.add_argument("--seed", type=int, help="engine seed (default: trainer.seed)")
    parser.add_argument("--out", help="results JSON (default: <trainer.output_dir>/eval.json)")
    parser.add_argument("--samples", help="also write every sample (response, reward) to this JSONL file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. eval.temperature=0.6 rollout.engine=sglang")


def _is_override(item: str) -> bool:
    """``eval.k=4`` typed after ``--files`` (which takes every word) is an override, not a file."""
    key = item.split("=", 1)[0]
    return "=" in item and key.split(".")[0] in Config.model_fields and "." in key


def run(args) -> int:
    if args.config and _is_override(args.config):  # `eval --model DIR eval.k=4`: no config given
        args.overrides = [args.config, *(args.overrides or [])]
        args.config = None
    file_args = [f for f in (args.files or []) if not _is_override(f)]
    overrides = [f for f in (args.files or []) if _is_override(f)] + list(args.overrides or [])
    if args.k is not None:
        overrides.append(f"eval.k={args.k}")
    if args.config:
        cfg = load_config(args.config, overrides)
    elif args.model:
        from megatron_alp.config import apply_overrides

        cfg = config_from_dict(apply_overrides({"model": {"hf_path": args.model}}, overrides), "--model")
    else:
        raise SystemExit("megatron-alp eval: pass a CONFIG file and/or --model DIR")
    model_dir = resolve_model(cfg, args.model)
    files = [parse_file_arg(f) for f in (file_args or cfg.eval.files or cfg.data.val_files)]
    seed = cfg.trainer.seed if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "eval.json"
    results = evaluate(cfg, model_dir, files, seed=seed, limit=args.limit,
                       samples_path=Path(args.samples) if args.samples else None)
    for name, s in results["benchmarks"].items():
        if s["skipped"]:
            print(f"{name}: skipped rows {s['skipped']}")
    print(format_table(results))
    _write_atomic(out, json.dumps(results, indent=2) + "\n")
    print(f"results written to {out}")
    return 0
