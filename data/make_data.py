"""Write the small data files shipped with megatron-alp (deterministic: rerun to reproduce them).

* ``arith/train.jsonl`` (2000) and ``arith/val.jsonl`` (200): one-step addition/subtraction of
  numbers below 50, in the paper's (verl) prompt format, for the CPU quickstart, where a tiny
  4-layer model is briefly warm-started on them and then trained with RL. Train and val share
  no problem.
* ``digits/train.jsonl`` (465) and ``digits/val.jsonl`` (155): every one-digit a + b and a - b
  (a >= b) in each phrasing; the TIR quickstart's task (its warm start teaches the model to copy
  the problem into code). val holds each problem once, in the first phrasing.
* ``largest/train.jsonl`` (2000) and ``largest/val.jsonl`` (200): "What is the largest number in
  [6,0,4,8]?" over distinct lists of 1-5 digits (val: lists that are not in train); the CPU
  quickstart's task, where RL must generalise to held-out problems rather than memorise a pool.
  Short lists come first in the draw (a one-digit list is a copy), so val holds longer ones.
* ``arith/sample.parquet``: the first 32 val problems as parquet (same columns, nested).
* ``benchmarks/*``: a handful of rows in each math benchmark's published column layout
  (Math500, Minerva, OlympiadBench, AIME24, AIME25), with synthetic problems, to test
  ``megatron-alp eval``'s layout detection without the real data sets.

Usage: ``python data/make_data.py [--out data]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.")
SEED = 20251122


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _atomic_write(path, lambda tmp: pq.write_table(pa.Table.from_pylist(rows), tmp))


def arithmetic_problems(rng: random.Random) -> list[tuple[str, int]]:
    """Every a + b and a - b (a >= b) with a, b < 50, shuffled, phrased with a random template."""
    pairs = [(a, "+", b) for a in range(50) for b in range(50)]
    pairs += [(a, "-", b) for a in range(50) for b in range(a + 1)]
    rng.shuffle(pairs)
    out = []
    for a, op, b in pairs:
        question = rng.choice(TEMPLATES).format(a=a, op=op, b=b)
        out.append((question, a + b if op == "+" else a - b))
    return out


def digit_problems() -> list[tuple[str, int, str]]:
    """(question, answer, template) for every one-digit a + b and a - b with a >= b."""
    pairs = [(a, "+", b) for a in range(10) for b in range(10)] + [(a, "-", b) for a in range(10) for b in range(a + 1)]
    return [(t.format(a=a, op=op, b=b), a + b if op == "+" else a - b, t) for a, op, b in pairs for t in TEMPLATES]


def largest_problems(rng: random.Random, count: int) -> list[tuple[str, int]]:
    """``count`` distinct lists of 1-5 digits (lengths 2-5 twice as likely as 1) and their maximum.
    Digits are written without spaces, so they are the same tokens as the answer's."""
    seen, out = set(), []
    while len(out) < count:
        digits = tuple(rng.randrange(10) for _ in range(rng.choice((1, 2, 2, 3, 3, 4, 4, 5, 5))))
        if digits not in seen:
            seen.add(digits)
            out.append((f"What is the largest number in [{','.join(map(str, digits))}]?", max(digits)))
    return out


def verl_row(question: str, answer: int, split: str, index: int) -> dict:
    return {
        "data_source": "arith",
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index},
    }


def benchmark_rows(rng: random.Random) -> dict[str, tuple[str, list[dict]]]:
    """Synthetic two-step problems in each benchmark's layout: file name -> (format, rows)."""

    def problem():
        a, b, c = rng.randrange(2, 13), rng.randrange(2, 13), rng.randrange(1, 30)
        return f"Compute {a} * {b} + {c}.", a * b + c

    def many(n):
        return [problem() for _ in range(n)]

    math500 = [{"problem": q, "solution": f"We get \\boxed{{{x}}}.", "answer": str(x), "subject": "Prealgebra",
                "level": 1, "unique_id": f"test/prealgebra/{i}.json"} for i, (q, x) in enumerate(many(8))]
    minerva = [{"problem": q, "solution": f"Multiplying first, the result is $\\boxed{{{x}}}$.", "type": "Arithmetic",
                "idx": i} for i, (q, x) in enumerate(many(8))]
    olympiad = [{"id": 1000 + i, "question": q, "solution": [f"The value is {x}."], "final_answer": [f"${x}$"],
                 "is_multiple_answer": False, "unit": None, "answer_type": "Numerical", "subfield": "Algebra",
                 "language": "English"} for i, (q, x) in enumerate(many(8))]
    aime24 = [{"ID": f"2024-I-{i + 1}", "Problem": q, "Solution": f"So the answer is {x}.", "Answer": x}
              for i, (q, x) in enumerate(many(6))]
    aime25 = [{"id": i, "problem": q, "answer": str(x)} for i, (q, x) in enumerate(many(6))]
    return {
        "math500.jsonl": ("jsonl", math500),
        "minerva.jsonl": ("jsonl", minerva),
        "olympiadbench.jsonl": ("jsonl", olympiad),
        "aime24.jsonl": ("jsonl", aime24),
        "aime25.parquet": ("parquet", aime25),
    }


def main(out: Path) -> None:
    rng = random.Random(SEED)
    problems = arithmetic_problems(rng)
    train = [verl_row(q, x, "train", i) for i, (q, x) in enumerate(problems[:2000])]
    val = [verl_row(q, x, "val", i) for i, (q, x) in enumerate(problems[2000:2200])]
    write_jsonl(out / "arith" / "train.jsonl", train)
    write_jsonl(out / "arith" / "val.jsonl", val)
    write_parquet(out / "arith" / "sample.parquet", val[:32])
    for name, (fmt, rows) in benchmark_rows(rng).items():
        (write_jsonl if fmt == "jsonl" else write_parquet)(out / "benchmarks" / name, rows)
    digits = digit_problems()
    random.Random(SEED).shuffle(digits)
    write_jsonl(out / "digits" / "train.jsonl", [verl_row(q, x, "train", i) for i, (q, x, _) in enumerate(digits)])
    once = [(q, x) for q, x, t in digits if t == TEMPLATES[0]]
    write_jsonl(out / "digits" / "val.jsonl", [verl_row(q, x, "val", i) for i, (q, x) in enumerate(once)])
    largest = largest_problems(random.Random(SEED), 2200)
    for split, rows in (("train", largest[:2000]), ("val", largest[2000:])):
        write_jsonl(out / "largest" / f"{split}.jsonl", [verl_row(q, x, split, i) for i, (q, x) in enumerate(rows)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    main(parser.parse_args().out)
