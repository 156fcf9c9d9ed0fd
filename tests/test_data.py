"""Prompt data: shipped files, reading/validation/tokenisation, deterministic resumable sampling."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_alp.config import DataConfig
from megatron_alp.data.prompts import DataError, PromptDataset, PromptSampler, load_tokenizer
from megatron_alp.models.tiny import save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
SYSTEM = DataConfig().system_prompt


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok")))


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _row(question, answer="3", system=True):
    msgs = ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": question}]
    return {"prompt": msgs, "reward_model": {"ground_truth": answer}, "data_source": "t"}


# ------------------------------------------------------------------------------ shipped data


def test_shipped_arithmetic_files():
    train, val = _rows(DATA / "arith" / "train.jsonl"), _rows(DATA / "arith" / "val.jsonl")
    assert len(train) == 2000 and len(val) == 200
    questions = set()
    for row in train + val:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": SYSTEM} and user["role"] == "user"
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", user["content"]).groups()
        assert int(row["reward_model"]["ground_truth"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert int(a) < 50 and int(b) < 50 and len(user["content"]) < 40
        questions.add((a, op, b))
    assert len(questions) == 2200, "train and val problems are distinct"
    parquet = pq.read_table(DATA / "arith" / "sample.parquet").to_pylist()
    assert parquet == val[:32]


def test_make_data_is_deterministic(tmp_path):
    subprocess.run([sys.executable, str(DATA / "make_data.py"), "--out", str(tmp_path)], check=True, timeout=120)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made and all((tmp_path / p).read_bytes() == (DATA / p).read_bytes() for p in made), (
        "data/ differs from what data/make_data.py writes: rerun it")


# ------------------------------------------------------------------------------- data set


def test_load_shipped_jsonl_and_parquet(tokenizer):
    cfg = DataConfig(train_files=[str(DATA / "arith" / "train.jsonl")],
                     val_files=[str(DATA / "arith" / "val.jsonl"), str(DATA / "arith" / "sample.parquet")])
    train = PromptDataset.from_config(cfg, tokenizer, max_prompt_length=2048)
    val = PromptDataset.from_config(cfg, tokenizer, max_prompt_length=2048, split="val")
    assert len(train) == 2000 and len(val) == 232 and train.skipped == {} and val.skipped == {}
    p = train[0]
    text = tokenizer.decode(p.prompt_ids)
    assert text.startswith("<|im_start|>system\n" + SYSTEM) and text.endswith("<|im_start|>assistant\n")
    assert p.messages[1]["content"] in text and p.source.endswith("train.jsonl:1")  # file:line
    assert p.ground_truth == _rows(DATA / "arith" / "train.jsonl")[0]["reward_model"]["ground_truth"]
    assert val[200].source.endswith("sample.parquet:1") and val[200].prompt_ids == val[0].prompt_ids
    head = train.head(64)
    assert len(head) == 64 and head[63].source == train[63].source and train.head(None) is train


def test_system_prompt_rules(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "What is 1 + 2?", "reward_model": {"ground_truth": 3}},
        _row("What is 2 + 2?", "4", system=False),
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "5 - 1?"}],
         "reward_model": {"ground_truth": "4"}},
    ])
    ds = PromptDataset.from_config(DataConfig(train_files=[path]), tokenizer, 512)
    assert [m["role"] for m in ds[0].messages] == ["system", "user"] and ds[0].messages[0]["content"] == SYSTEM
    assert ds[0].ground_truth == "3"
    assert ds[1].messages[0]["content"] == SYSTEM
    assert ds[2].messages[0]["content"] == "Be brief."
    bare = PromptDataset.from_config(DataConfig(train_files=[path], system_prompt=None), tokenizer, 512)
    assert [m["role"] for m in bare[0].messages] == ["user"]
    assert len(bare[0].prompt_ids) < len(ds[0].prompt_ids)
    replaced = PromptDataset.from_config(DataConfig(train_files=[path], system_prompt="Use code.",
                                                    replace_system_prompt=True), tokenizer, 512)
    assert [[m["content"] for m in p.messages if m["role"] == "system"] for p in replaced] == [["Use code."]] * 3


MALFORMED = [  # (row, the reason it cannot be used; None: usable)
    (_row("What is 1 + 2?"), None),
    ({"prompt": [{"role": "user", "content": "2 + 2?"}]}, "no_ground_truth"),
    ({"prompt": [{"role": "user", "content": "2 + 2?"}], "reward_model": {"ground_truth": ""}}, "no_ground_truth"),
    ({"prompt": [{"role": "user", "content": "   "}], "reward_model": {"ground_truth": "1"}}, "empty_prompt"),
    ({"prompt": "", "reward_model": {"ground_truth": "1"}}, "empty_prompt"),
    ({"prompt": [{"role": "wizard", "content": "hi"}], "reward_model": {"ground_truth": "1"}}, "bad_messages"),
    ({"prompt": 42, "reward_model": {"ground_truth": "1"}}, "bad_messages"),
    ("{not json", "bad_json"),
    (_row("What is " + " + ".join(["1"] * 200) + "?"), "too_long"),
    (_row("What is 3 + 4?", "7"), None),
]


def test_a_bad_row_is_an_error_naming_its_line(tmp_path, tokenizer):
    """By default an unusable row stops the load, naming file:line and what was expected (lines that
    are not JSON are found first: the file is read before its rows are checked)."""
    path = _write_jsonl(tmp_path / "d.jsonl", [row for row, _ in MALFORMED])
    with pytest.raises(DataError, match=r"d\.jsonl:8: bad row: expected one JSON object per line .*data.skip_bad_rows"):
        PromptDataset.from_config(DataConfig(train_files=[path]), tokenizer, max_prompt_length=128)
    valid_json = _write_jsonl(tmp_path / "v.jsonl", [row for row, reason in MALFORMED if reason != "bad_json"])
    with pytest.raises(DataError, match=r"v\.jsonl:2: bad row: expected a ground-truth answer \(data.answer_key\)"):
        PromptDataset.from_config(DataConfig(train_files=[valid_json]), tokenizer, max_prompt_length=128)


def test_skip_bad_rows_reports_counts_and_places(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [row for row, _ in MALFORMED])
    ds = PromptDataset.from_config(DataConfig(train_files=[path], skip_bad_rows=True), tokenizer, max_prompt_length=128)
    assert [p.ground_truth for p in ds] == ["3", "7"]
    expected: dict = {}
    for line, (_, reason) in enumerate(MALFORMED, 1):
        if reason is not None:
            expected.setdefault(reason, []).append(f"{path}:{line}")
    assert ds.skipped == {reason: len(places) for reason, places in expected.items()}
    assert ds.bad.places == {r: p for r, p in expected.items() if r != "too_long"} and ds.too_long == expected["too_long"]
    report = "\n".join(ds.report(128))
    assert "skipped 7 bad rows (data.skip_bad_rows)" in report and f"bad_json 1 ({path}:8)" in report
    assert f"1 prompts longer than rollout.sampling.max_prompt_length=128 tokens left out ({path}:9)" in report


def test_nested_answer_key_and_lists(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"question": "1 + 1?", "meta": {"answers": ["$2$"]}},
        {"question": "x?", "meta": {"answers": ["1", "-1"]}},
        {"question": "y?", "meta": {"answers": []}},
    ]), path)
    cfg = DataConfig(train_files=[str(path)], prompt_key="question", answer_key="meta.answers", skip_bad_rows=True)
    ds = PromptDataset.from_config(cfg, tokenizer, 512)
    assert [p.ground_truth for p in ds] == ["2", "1, -1"] and ds.bad.places == {"no_ground_truth": [f"{path}:3"]}


def test_file_errors_name_the_file_and_key(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"data file .*missing\.jsonl does not exist"):
        PromptDataset.from_config(DataConfig(train_files=[str(tmp_path / "missing.jsonl")]), tokenizer, 512)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown format '\.csv'"):
        PromptDataset.from_config(DataConfig(train_files=[str(tmp_path / "d.csv")]), tokenizer, 512)
    path = _write_jsonl(tmp_path / "d.jsonl", [_row("1 + 2?")])
    with pytest.raises(DataError, match=r"d\.jsonl: no row has a value at column 'question' \(config key data.prompt_key\)"):
        PromptDataset.from_config(DataConfig(train_files=[path], prompt_key="question"), tokenizer, 512)
    with pytest.raises(DataError, match=r"'reward_model.answer' \(config key data.answer_key\)"):
        PromptDataset.from_config(DataConfig(train_files=[path], answer_key="reward_model.answer"), tokenizer, 512)
    with pytest.raises(DataError, match="data.val_files is empty"):
        PromptDataset.from_config(DataConfig(train_files=[path]), tokenizer, 512, split="val")
    with pytest.raises(DataError, match=r"no usable prompts .*too_long"):
        PromptDataset.from_config(DataConfig(train_files=[path]), tokenizer, 5)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable parquet file"):
        PromptDataset.from_config(DataConfig(train_files=[str(tmp_path / "bad.parquet")]), tokenizer, 512)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    tok_dir = save_tokenizer(tmp_path / "tok")
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tok_dir)


# -------------------------------------------------------------------------------- sampler


def test_sampler_epochs_are_permutations():
    """Any sequence works as the data set; plain ints make orders easy to compare."""
    data = list(range(10))
    s = PromptSampler(data, seed=3)
    batches = [list(s.next_batch(4)) for _ in range(5)]  # 20 items = 2 epochs
    flat = sum(batches, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != list(range(10)) and flat[:10] != flat[10:], "shuffled, differently each epoch"
    assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (1, 10), "epochs roll over lazily"
    again = PromptSampler(data, seed=3)
    assert sum((list(again.next_batch(4)) for _ in range(5)), []) == flat, "deterministic in the seed"
    other = PromptSampler(data, seed=4)
    assert list(other.next_batch(10)) != flat[:10]
    plain = PromptSampler(data, seed=3, shuffle=False)
    assert list(plain.next_batch(13)) == list(range(10)) + [0, 1, 2]
    assert len(PromptSampler(data, seed=0).next_batch(25)) == 25


def test_sampler_resumes_exactly():
    data = list(range(7))
    ref = PromptSampler(data, seed=11)
    expected = [list(ref.next_batch(3)) for _ in range(6)]
    first = PromptSampler(data, seed=11)
    got = [list(first.next_batch(3)) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON/pickle
    resumed = PromptSampler(data, seed=11)
    resumed.load_state_dict(state)
    got += [list(resumed.next_batch(3)) for _ in range(4)]
    assert got == expected


def test_sampler_state_mismatch_is_an_error():
    s = PromptSampler(list(range(7)), seed=1)
    s.next_batch(2)
    state = s.state_dict()
    with pytest.raises(ValueError, match="7 prompts but the configured data has 8"):
        PromptSampler(list(range(8)), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="data.seed=2"):
        PromptSampler(list(range(7)), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing 'position'"):
        PromptSampler(list(range(7)), seed=1).load_state_dict({"epoch": 0, "num_prompts": 7})
    with pytest.raises(ValueError, match="non-empty"):
        PromptSampler(list(), seed=1)
