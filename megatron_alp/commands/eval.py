"""`megatron-alp eval [CONFIG] [--model MODEL]`: average@k and pass@k on math benchmarks.

Each problem gets ``eval.k`` samples from a rollout engine of the command's own (vLLM or SGLang,
as configured), scored by the configured reward; the benchmark files, the estimators and the
sampling are those of validation during training (:mod:`megatron_alp.batches.evaluation`).

``--model`` is a Hugging Face directory, a checkpoint of a run (``RUN/checkpoints/iter_N``,
exported once to ``RUN/exports/iter_N``) or a run directory (its newest checkpoint); without it,
the config's model (``model.hf_path``, or the run's tiny base model). Results go to
``trainer.output_dir/eval/<model>.json``, named after what was evaluated, so evaluating the base
model and a trained checkpoint keeps both; engine and library output to ``<model>.log`` beside it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from megatron_alp.batches.evaluation import load_benchmark, response_budget, summarize
from megatron_alp.batches.sampling import eval_params, sample
from megatron_alp.commands.context import library_log, one_process, write_json, write_text
from megatron_alp.commands.context import model_dir as resolve_model_dir
from megatron_alp.commands.session import Session
from megatron_alp.config import Config, ConfigError, InputError, ParallelConfig, apply_overrides
from megatron_alp.data.prompts import Prompt, load_tokenizer
from megatron_alp.models.families import load_hf_config
from megatron_alp.resolve import config_from_dict, load_config
from megatron_alp.rewards import build_reward
from megatron_alp.runtime.console import held_warnings, say
from megatron_alp.tir.sandbox import SandboxExecutor
from megatron_alp.training.dist_checkpoint import latest_checkpoint
from megatron_alp.training.export import export_hf
from megatron_alp.training.policy import weights_kind


def parse_file_arg(item: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after the file: ``aime24.jsonl`` -> ``aime24``)."""
    if "=" in item and not Path(item).exists():
        name, path = item.split("=", 1)
        return name.strip(), path.strip()
    return Path(item).name.split(".")[0].lower(), item


def generate(cfg: Config, model_dir: str, prompts: list[Prompt], seed: int):
    """Texts (len(prompts) * k, grouped by prompt) and response lengths, from the rollout engine.
    The engine context is prompt + ``eval.max_response_length``, at most the model's
    ``max_position_embeddings``; an explicit ``rollout.max_model_len`` is taken as the context."""
    ev = cfg.eval
    longest = max(len(p.prompt_ids) for p in prompts)
    wanted = longest + ev.max_response_length
    positions = int(load_hf_config(model_dir).get("max_position_embeddings", wanted))
    if cfg.rollout.max_model_len and cfg.rollout.max_model_len > positions:
        raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                          f"max_position_embeddings={positions}")
    context = cfg.rollout.max_model_len or min(wanted, positions)
    max_tokens = response_budget(ev, context, longest, log=say)
    sampling = cfg.rollout.sampling.model_copy(
        update=dict(n=ev.k, temperature=ev.temperature, top_p=ev.top_p, top_k=-1, max_response_length=max_tokens))
    rollout_cfg = cfg.rollout.model_copy(update=dict(sampling=sampling, max_model_len=context))
    params = eval_params(ev, max_tokens)
    ids = [p.prompt_ids for p in prompts]
    with Session(cfg, model_dir, seed=seed, megatron=False) as session:
        engine = session.engine(rollout_cfg)
        if cfg.tir.enabled:
            with SandboxExecutor(cfg.tir.sandbox) as executor:
                trajs = sample(engine, ids, params, cfg.tir, session.tokenizer, executor)
        else:
            trajs = sample(engine, ids, params, cfg.tir)
    return [t.response_text for t in trajs], [len(t.response_ids) for t in trajs]


def evaluate(cfg: Config, model_dir: str, files: list[tuple[str, str]], *, seed: int,
             limit: Optional[int] = None, samples_path: Optional[Path] = None) -> dict:
    """Score ``model_dir`` on each (name, path) benchmark; returns the results dict."""
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
        write_text(samples_path, "".join(json.dumps(r) + "\n" for r in records))
    return results


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


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?",
                        help="run config (YAML); its rollout, reward, data and eval sections are used")
    parser.add_argument("--model", help="what to evaluate: a Hugging Face model directory, a run's checkpoint "
                        "(RUN/checkpoints/iter_N) or a run directory (its newest checkpoint); default: the config's "
                        "model (model.hf_path, or the run's tiny base model)")
    parser.add_argument("--files", nargs="+",
                        help="benchmark files, PATH or NAME=PATH (default: eval.files, else data.val_files)")
    parser.add_argument("--k", type=int, help="samples per problem (default: eval.k)")
    parser.add_argument("--limit", type=int, help="only the first N problems of each file (smoke runs)")
    parser.add_argument("--seed", type=int, help="engine seed (default: trainer.seed)")
    parser.add_argument("--out", help="results JSON (default: <trainer.output_dir>/eval/<model>.json; the "
                        "engine log goes beside it)")
    parser.add_argument("--samples", help="also write every sample (response, reward) to this JSONL file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. eval.temperature=0.6 rollout.engine=sglang")


def _is_override(item: str) -> bool:
    """``eval.k=4`` typed after ``--files`` (which takes every word) is an override, not a file."""
    key = item.split("=", 1)[0]
    return "=" in item and key.split(".")[0] in Config.model_fields and "." in key


def evaluated_model(cfg: Config, model: Optional[str]) -> tuple[Path, str]:
    """What to evaluate and the name of its results: ``--model`` (an HF directory, a run's
    checkpoint, or a run directory: its newest checkpoint), else the config's model."""
    path = Path(model) if model else None
    if path is not None and not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise InputError(f"--model {path}: the run directory has no complete checkpoint yet")
        path = newest
    if path is not None and weights_kind(path, "--model") == "megatron":
        return path, path.name
    hf_dir = resolve_model_dir(cfg, model)
    return hf_dir, hf_dir.resolve().name


def as_hf_dir(path: Path, seed: int) -> Path:
    """``path`` itself when it is a Hugging Face directory; a checkpoint's export to
    ``RUN/exports/iter_N`` (written on first use)."""
    if weights_kind(path) != "megatron":
        return path
    exported = path.parent.parent / "exports" / path.name
    if not (exported / "config.json").is_file():
        say(f"exporting {path} to {exported} (Hugging Face safetensors, once)")
        with one_process(seed):
            export_hf(path, exported, ParallelConfig())
    return exported


def run(args) -> int:
    if args.config and _is_override(args.config):  # `eval --model DIR eval.k=4`: no config given
        args.overrides = [args.config, *(args.overrides or [])]
        args.config = None
    file_args = [f for f in (args.files or []) if not _is_override(f)]
    overrides = [f for f in (args.files or []) if _is_override(f)] + list(args.overrides or [])
    if args.k is not None:
        overrides.append(f"eval.k={args.k}")
    with held_warnings():
        if args.config:
            cfg = load_config(args.config, overrides)
        elif args.model:
            cfg = config_from_dict(apply_overrides({"model": {"hf_path": args.model}}, overrides), "--model")
        else:
            raise SystemExit("megatron-alp eval: pass a CONFIG file and/or --model MODEL")
    seed = cfg.trainer.seed if args.seed is None else args.seed
    files = [parse_file_arg(f) for f in (file_args or cfg.eval.files or cfg.data.val_files)]
    model, name = evaluated_model(cfg, args.model)
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "eval" / f"{name}.json"
    with library_log(out.with_suffix(".log"), "eval"):
        model_dir = as_hf_dir(model, seed)
        results = evaluate(cfg, str(model_dir), files, seed=seed, limit=args.limit,
                           samples_path=Path(args.samples) if args.samples else None)
    for bench, s in results["benchmarks"].items():
        if s["skipped"]:
            say(f"{bench}: left out rows {s['skipped']}")
    say(format_table(results))
    write_json(out, results)
    say(f"megatron-alp eval: wrote {out} (the scores of {model_dir})"
        + (f" and the samples to {args.samples}" if args.samples else ""))
    return 0
