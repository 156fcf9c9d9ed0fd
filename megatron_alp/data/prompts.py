"""Prompt data sets: reading, validating and tokenising prompts, and sampling them in a
deterministic, resumable order.

Rows follow the paper's (and verl's) layout: ``prompt`` is a chat message list (system + user)
or a plain string, and the ground truth sits at a dotted path (``reward_model.ground_truth``).
Prompts are rendered with the tokenizer's own chat template, so the rollout engine and the
trainer see exactly the token ids the model was trained on.

A row that cannot be used (a line that is not a JSON object, an empty or malformed prompt, no
ground truth) is an error naming ``file:line`` and what was expected (:class:`BadRows`), unless
``data.skip_bad_rows`` is set, which skips such rows and reports how many and where. A prompt
longer than ``rollout.sampling.max_prompt_length`` is a valid row the run leaves out: counted and
reported (``too_long``). A file that cannot be used (missing, unknown format, no such column) is an
error naming the file and the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from megatron_alp.config import Config, DataConfig, InputError

ROLES = ("system", "user", "assistant", "tool")
_MISSING = object()


class DataError(InputError):
    """A data file or column cannot be used; the message names the file and the key."""


@dataclass
class Prompt:
    prompt_ids: list[int]
    ground_truth: str
    messages: list[dict]
    source: str  # "file:N" (the row's place, :class:`Row`), for tracing a sample back to its data


# what a usable row has, by the reason a row is not usable
EXPECTED = {
    "bad_json": "one JSON object per line",
    "empty_prompt": "a non-empty prompt (data.prompt_key)",
    "bad_messages": "a prompt that is a string or a list of {role, content} chat messages (data.prompt_key)",
    "no_ground_truth": "a ground-truth answer (data.answer_key)",
}


class SkipRow(Exception):
    """A row is malformed; ``reason`` is a key of :data:`EXPECTED` (or ``too_long``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BadRows:
    """The rows a data set cannot use. By default the first one is a :class:`DataError` naming its
    ``file:line`` and what was expected; with ``skip`` (``data.skip_bad_rows``) they are left out,
    counted by reason with their places (:meth:`report`)."""

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.places: dict[str, list[str]] = {}

    def add(self, reason: str, place: str) -> None:
        if not self.skip:
            raise DataError(f"{place}: bad row: expected {EXPECTED[reason]} (data.skip_bad_rows: true skips such "
                            "rows and reports them)")
        self.places.setdefault(reason, []).append(place)

    @property
    def counts(self) -> dict[str, int]:
        return {reason: len(places) for reason, places in self.places.items()}

    def report(self, shown: int = 3) -> Optional[str]:
        """``skipped 3 bad rows: bad_json 2 (a.jsonl:4, a.jsonl:9), ...`` or None when there were none."""
        if not self.places:
            return None
        parts = [f"{reason} {len(p)} ({', '.join(p[:shown])}{', ...' if len(p) > shown else ''})"
                 for reason, p in self.places.items()]
        return f"skipped {sum(self.counts.values())} bad rows (data.skip_bad_rows): {'; '.join(parts)}"


@dataclass
class Row:
    place: str  # "file:N": the line of a jsonl file, the row (from 1) of a parquet file or JSON list
    data: dict


# ------------------------------------------------------------------------------------ files


def read_rows(path: str | Path, bad: Optional[BadRows] = None) -> list[Row]:
    """All rows of a ``.jsonl``/``.json``/``.parquet`` file with their places. A line of a jsonl file
    that is not a JSON object goes to ``bad`` (by default: an error naming the line)."""
    path = Path(path)
    bad = bad if bad is not None else BadRows()
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a corrupt file
            raise DataError(f"data file {path}: not a readable parquet file ({err})") from None
        return [Row(f"{path}:{i}", r) for i, r in enumerate(rows, 1)]
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
            if not all(isinstance(r, dict) for r in rows):
                raise DataError(f"data file {path}: expected a JSON list of objects")
            return [Row(f"{path}:{i}", r) for i, r in enumerate(rows, 1)]
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                out.append(Row(f"{path}:{number}", row))
            else:
                bad.add("bad_json", f"{path}:{number}")
        return out
    raise DataError(f"data file {path}: unknown format {suffix!r} (expected .parquet or .jsonl)")


def get_path(row: dict, dotted: str, default: Any = _MISSING) -> Any:
    """``row['a']['b']`` for ``dotted='a.b'``; ``default`` (or KeyError) when any part is missing."""
    node: Any = row
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif default is not _MISSING:
            return default
        else:
            raise KeyError(dotted)
    return node


def check_column(rows: list[Row], dotted: str, path: str | Path, field: str) -> None:
    """Error naming the file and key when no row has column ``dotted`` (a typo in the config, not
    a few bad rows)."""
    if rows and not any(get_path(r.data, dotted, None) is not None for r in rows):
        found = sorted({k for r in rows[:100] for k in r.data})
        raise DataError(
            f"data file {path}: no row has a value at column {dotted!r} (config key data.{field}); "
            f"columns found: {found}"
        )


# ---------------------------------------------------------------------------------- content


def normalize_answer(value: Any) -> str:
    """Ground truth as a non-empty string: numbers are formatted, one-element lists unwrapped,
    several answers joined with ", " (math-verify accepts a list of answers written that way)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        parts = [normalize_answer(v) for v in value if v is not None]
        parts = [p for p in parts if p]
        if not parts:
            raise SkipRow("no_ground_truth")
        return parts[0] if len(parts) == 1 else ", ".join(parts)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise SkipRow("no_ground_truth")
    if isinstance(value, bool):
        raise SkipRow("no_ground_truth")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$").strip()
    if not text:
        raise SkipRow("no_ground_truth")
    return text


def build_messages(prompt: Any, system_prompt: Optional[str], replace: bool = False) -> list[dict]:
    """Chat messages for a prompt given as a string or a message list; the system prompt is added
    when there is no system message (and, with ``replace``, takes the place of the one there is).
    Raises :class:`SkipRow` for unusable prompts."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise SkipRow("empty_prompt")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        messages = []
        for m in prompt:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise SkipRow("bad_messages")
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "user" and m["content"].strip() for m in messages):
            raise SkipRow("empty_prompt")
    elif prompt is None:
        raise SkipRow("empty_prompt")
    else:
        raise SkipRow("bad_messages")
    if system_prompt and replace:
        messages = [m for m in messages if m["role"] != "system"]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the rendered chat, ending with the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_prompt(tokenizer, messages: list[dict], ground_truth: str, source: str,
                max_prompt_length: int) -> Prompt:
    ids = encode_messages(tokenizer, messages)
    if len(ids) > max_prompt_length:
        raise SkipRow("too_long")
    return Prompt(prompt_ids=ids, ground_truth=ground_truth, messages=messages, source=source)


def load_tokenizer(model_dir: str | Path):
    """The model's Hugging Face tokenizer; it must carry a chat template (prompts are rendered
    with it, exactly as the rollout engine would)."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (expected a Hugging Face model dir)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:
        raise ValueError(f"cannot load a tokenizer from {path}: {err}") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {path} has no chat template (tokenizer_config.json `chat_template` or "
            "chat_template.jinja); prompts are rendered with it, so add one (e.g. the instruct "
            "model's template)"
        )
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path} has no eos_token; generation would never stop")
    return tok


def pad_id(tokenizer) -> int:
    """The token id that pads batches: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# --------------------------------------------------------------------------------- data set


def prompt_rows(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "reward_model.ground_truth",
                system_prompt: Optional[str] = None, replace_system_prompt: bool = False,
                bad: Optional[BadRows] = None) -> list[tuple[str, list[dict], str]]:
    """``(place, chat messages, ground truth)`` of every usable row of a training-format file;
    unusable rows go to ``bad`` (by default: an error naming the first). Needs no tokenizer, so a
    run checks its files before it starts anything."""
    bad = bad if bad is not None else BadRows()
    rows = read_rows(path, bad)
    check_column(rows, prompt_key, path, "prompt_key")
    check_column(rows, answer_key, path, "answer_key")
    out = []
    for row in rows:
        try:
            answer = normalize_answer(get_path(row.data, answer_key, None))
            messages = build_messages(get_path(row.data, prompt_key, None), system_prompt, replace_system_prompt)
        except SkipRow as s:
            bad.add(s.reason, row.place)
            continue
        out.append((row.place, messages, answer))
    return out


class PromptDataset:
    """Every usable prompt of the configured files, tokenised, in file order; ``too_long`` holds the
    places of the prompts left out for their length, ``bad`` the rows skipped as unusable."""

    def __init__(self, prompts: list[Prompt], too_long: Optional[list[str]] = None, bad: Optional[BadRows] = None):
        self.prompts = prompts
        self.too_long = list(too_long or [])
        self.bad = bad if bad is not None else BadRows()

    @property
    def skipped(self) -> dict[str, int]:
        """Rows left out, counted by reason."""
        return {**self.bad.counts, **({"too_long": len(self.too_long)} if self.too_long else {})}

    def report(self, max_prompt_length: int) -> list[str]:
        """What the data set left out, for the terminal (nothing when it took every row)."""
        lines = [self.bad.report()] if self.bad.places else []
        if self.too_long:
            shown = ", ".join(self.too_long[:3]) + (", ..." if len(self.too_long) > 3 else "")
            lines.append(f"{len(self.too_long)} prompts longer than rollout.sampling.max_prompt_length="
                         f"{max_prompt_length} tokens left out ({shown})")
        return lines

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer, max_prompt_length: int, split: str = "train") -> "PromptDataset":
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val' (got {split!r})")
        files = cfg.train_files if split == "train" else cfg.val_files
        if not files:
            raise DataError(f"data.{split}_files is empty: list the {split} prompt files (.parquet or .jsonl)")
        return cls.from_files(files, tokenizer, max_prompt_length, prompt_key=cfg.prompt_key,
                              answer_key=cfg.answer_key, system_prompt=cfg.system_prompt,
                              replace_system_prompt=cfg.replace_system_prompt, skip_bad_rows=cfg.skip_bad_rows)

    @classmethod
    def from_files(cls, files: list[str], tokenizer, max_prompt_length: int, *, prompt_key: str = "prompt",
                   answer_key: str = "reward_model.ground_truth", system_prompt: Optional[str] = None,
                   replace_system_prompt: bool = False, skip_bad_rows: bool = False) -> "PromptDataset":
        prompts: list[Prompt] = []
        too_long: list[str] = []
        bad = BadRows(skip_bad_rows)
        for path in files:
            for place, messages, answer in prompt_rows(path, prompt_key=prompt_key, answer_key=answer_key,
                                                       system_prompt=system_prompt,
                                                       replace_system_prompt=replace_system_prompt, bad=bad):
                try:
                    prompts.append(make_prompt(tokenizer, messages, answer, place, max_prompt_length))
                except SkipRow:
                    too_long.append(place)
        if not prompts:
            raise DataError(f"no usable prompts in {list(files)} (left out by reason: "
                            f"{ {**bad.counts, 'too_long': len(too_long)} })")
        return cls(prompts, too_long, bad)

    def head(self, n: Optional[int]) -> "PromptDataset":
        """The first ``n`` prompts (all of them when ``n`` is None)."""
        return self if n is None else PromptDataset(self.prompts[:n], self.too_long, self.bad)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)


class PromptSampler:
    """Prompts in shuffled epochs: each epoch is a permutation drawn from (seed, epoch), so the
    order is reproducible and resuming needs only the epoch and the position in it."""

    def __init__(self, dataset, seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("PromptSampler needs a non-empty dataset")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts; a batch that crosses an epoch end continues in the next epoch."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1 (got {n})")
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch.extend(self.dataset[int(i)] for i in self._order[self.position: self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.dataset)}

    def load_state_dict(self, d: dict) -> None:
        for key in ("epoch", "position", "num_prompts"):
            if key not in d:
                raise ValueError(f"sampler state is missing {key!r} (got keys {sorted(d)})")
        if d["num_prompts"] != len(self.dataset):
            raise ValueError(
                f"sampler state was saved for a data set of {d['num_prompts']} prompts but the configured "
                f"data has {len(self.dataset)}: resume with the same data files (and max_prompt_length)"
            )
        if d.get("seed", self.seed) != self.seed or d.get("shuffle", self.shuffle) != self.shuffle:
            raise ValueError(
                f"sampler state was saved with seed={d.get('seed')} shuffle={d.get('shuffle')}, the config "
                f"has data.seed={self.seed} data.shuffle={self.shuffle}"
            )
        if not 0 <= d["position"] <= len(self.dataset):
            raise ValueError(f"sampler state position {d['position']} is outside 0..{len(self.dataset)}")
        self.epoch = int(d["epoch"])
        self.position = int(d["position"])
        self._order = self._permutation(self.epoch)


def training_sampler(cfg: Config, tokenizer, log: Optional[Callable[[str], None]] = None) -> PromptSampler:
    """What a run draws its prompts from: the first ``data.max_train_prompts`` of ``data.train_files``,
    in ``data.seed``'s order; ``log`` gets the data set's report lines."""
    longest = cfg.rollout.sampling.max_prompt_length
    dataset = PromptDataset.from_config(cfg.data, tokenizer, longest, split="train").head(cfg.data.max_train_prompts)
    for line in dataset.report(longest) if log is not None else ():
        log(f"data: {line}")
    return PromptSampler(dataset, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
