"""Scoring a policy on benchmark files: average@k and pass@k, by ``megatron-alp eval`` with an engine
of its own and by validation during training (``trainer.eval_interval``) with the run's engine.

Each problem gets ``eval.k`` samples; each sample is scored by the configured reward (math-verify on
the final ``\\boxed{}`` answer). average@k is the mean accuracy over all samples (the paper reports
average@32 at temperature 1.0 with a 4096-token limit); pass@k is the unbiased estimate of
:mod:`~megatron_alp.algorithms.pass_at_k`.

Benchmark files keep their published column layouts, detected from the columns: Math500 and
AIME (``problem``/``answer``, any capitalisation), Minerva (``problem`` + a ``solution`` with a
boxed answer), OlympiadBench (``question`` + ``final_answer`` list), ``question``/``answer``, and
the training format (``prompt`` + ``reward_model.ground_truth``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from megatron_alp.algorithms.pass_at_k import score_matrix
from megatron_alp.batches.sampling import eval_params, sample
from megatron_alp.config import Config, ConfigError, EvalConfig
from megatron_alp.data.prompts import (
    BadRows,
    DataError,
    Prompt,
    SkipRow,
    build_messages,
    get_path,
    make_prompt,
    normalize_answer,
    read_rows,
)
from megatron_alp.rewards.math_verify import extract_boxed


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
    skipped: dict  # rows left out, by reason (bad rows with data.skip_bad_rows; too_long)


def benchmark_rows(path: str, cfg: Config, bad: BadRows, limit: Optional[int] = None
                   ) -> tuple[str, list[tuple[str, list[dict], str]]]:
    """The file's layout and ``(place, chat messages, ground truth)`` of its usable rows (the first
    ``limit``); unusable rows go to ``bad``. Needs no tokenizer: a run checks its files first."""
    rows = read_rows(path, bad)
    if not rows:
        raise DataError(f"benchmark file {path} has no rows")
    columns = {k for r in rows for k in r.data}
    layout, extract = detect_layout(columns, cfg.data.prompt_key, cfg.data.answer_key)
    out = []
    for row in rows[:limit] if limit else rows:
        try:
            question, answer = extract(row.data)
            messages = build_messages(question, cfg.data.system_prompt, cfg.data.replace_system_prompt)
            out.append((row.place, messages, normalize_answer(answer)))
        except SkipRow as s:
            bad.add(s.reason, row.place)
    return layout, out


def load_benchmark(name: str, path: str, tokenizer, cfg: Config, limit: Optional[int] = None) -> Benchmark:
    bad = BadRows(cfg.data.skip_bad_rows)
    layout, rows = benchmark_rows(path, cfg, bad, limit)
    prompts, too_long = [], 0
    for place, messages, answer in rows:
        try:
            prompts.append(make_prompt(tokenizer, messages, answer, place, cfg.rollout.sampling.max_prompt_length))
        except SkipRow:
            too_long += 1
    skipped = {**bad.counts, **({"too_long": too_long} if too_long else {})}
    if not prompts:
        raise DataError(f"benchmark {name} ({path}): no usable problems (left out by reason: {skipped})")
    return Benchmark(name, str(path), layout, prompts, skipped)


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

    def run(self, rollout, *, seed: Optional[int], reward_fn, tokenizer, executor=None) -> dict:
        """``val/*`` metrics (:func:`validation_metrics`) on the rank holding ``reward_fn``, {} on
        the others. ``seed`` seeds the samples (:class:`~megatron_alp.rollout.base.SamplingParams`):
        the same seed at every evaluation makes successive scores differ by the policy, not the draw."""
        ev = self.cfg.eval
        trajs = sample(rollout, [p.prompt_ids for p in self.prompts], eval_params(ev, self.max_tokens, seed),
                       self.cfg.tir, tokenizer, executor, rollout.broadcast)
        if reward_fn is None:
            return {}
        texts = [t.response_text for t in trajs]
        rewards = reward_fn(texts, [p.ground_truth for p in self.prompts for _ in range(ev.k)])
        results, _ = summarize(self.benches, texts, [len(t.response_ids) for t in trajs], rewards, ev)
        return validation_metrics(results)


