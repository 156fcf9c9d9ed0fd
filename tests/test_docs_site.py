"""The documentation site builds in strict mode (no broken link or anchor, no page outside the nav, no
missing snippet), and what its pages and the README quote is current: every command a page shows
takes the options it is shown with, every config key it names exists (with the value it names, where
the key takes a fixed set), so a renamed flag or key cannot leave a page behind."""

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from megatron_alp.commands import COMMANDS, command_parser
from megatron_alp.commands.config_docs import PAGES
from megatron_alp.config import Config

ROOT = Path(__file__).resolve().parents[1]
# hand-written pages (the generated ones are held to their generator by tests/test_config_docs.py)
PAGES_QUOTING = sorted({ROOT / "README.md", *(ROOT / "docs").rglob("*.md")} - {ROOT / "docs" / p for p in PAGES})
FILE_SUFFIXES = (".py", ".json", ".jsonl", ".yaml", ".md", ".png", ".log", ".safetensors", ".sh", ".parquet")


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (it comes with the dev extra: pip install -e '.[dev]')")
def test_site_builds_in_strict_mode(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "rollout.sync_delta_anchor" in changelog  # CHANGELOG.md itself, included


def _schema() -> dict[str, object]:
    """Every dotted key of the config (sections too) -> its annotation."""
    keys: dict[str, object] = {}

    def walk(prefix: str, cls: type[BaseModel]):
        for name, field in cls.model_fields.items():
            keys[prefix + name] = field.annotation
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(f"{prefix}{name}.", field.annotation)

    walk("", Config)
    return keys


SCHEMA = _schema()
KEY = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)(\*)?(?:\s*[:=]\s*(\S.*)?)?$")


def key_problem(text: str) -> str | None:
    """What is wrong with a quoted `section.key`, `section.key: value` or `section.key=value`; None when
    it is right or is no config key (another dotted name: a file, a module, a metric)."""
    m = KEY.match(text.strip().rstrip(",.;"))
    if not m or m.group(1).split(".")[0] not in Config.model_fields or m.group(1).endswith(FILE_SUFFIXES):
        return None
    key, star, value = m.groups()
    if star:
        return None if any(k.startswith(key) for k in SCHEMA) else f"no config key starts with {key}"
    if key not in SCHEMA:
        return f"no config key {key}"
    if value and typing.get_origin(SCHEMA[key]) is typing.Literal:
        value = value.strip().strip("'\"")
        if value not in {str(v) for v in typing.get_args(SCHEMA[key])}:
            return f"{key}: {value!r} is none of {typing.get_args(SCHEMA[key])}"
    return None


def _inline_keys(text: str):
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        pieces = [span] if ": " in span and "=" not in span else span.split()
        yield from pieces


def _shell_lines(text: str):
    """The command lines of fenced blocks: a bash block's lines, a text block's `$ ` lines; a trailing
    backslash continues a line."""
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            line = line.strip()
            if lang == "text":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif lang not in ("bash", "sh", "") or line.startswith("#"):
                continue
            for part in line.split("&&"):
                yield part.split(" #")[0].strip()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def command_problems(line: str) -> list[str]:
    """What is stale in one quoted command line; [] when it is current or is not one of ours."""
    try:
        words = shlex.split(line)
    except ValueError:
        return [f"cannot split {line!r}"]
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] in ("bash", "sbatch", "python", "docker")
                     or (words[0].startswith("--") and words[0] != "--debug")):
        words = words[1:]  # environment, the interpreter, sbatch's own options
    if not words:
        return []
    tool, args = words[0].removeprefix(".venv/bin/"), words[1:]
    problems = [f"{w} does not exist" for w in args if w.startswith("configs/") and not (ROOT / w).exists()]
    problems += [f"{w}: {p}" for w in args if "=" in w and (p := key_problem(w))]
    if tool.startswith(("launch/", "benchmarks/")):
        if not (ROOT / tool).is_file():
            return problems + [f"{tool} does not exist"]
        if tool == "launch/ngc_run.sh" and args[:1] == ["megatron-alp"]:
            return problems + command_problems(" ".join(args))
        source = (ROOT / tool).read_text()
        return problems + [f"{tool} has no option {w.split('=')[0]}" for w in args
                           if w.startswith("--") and f'"{w.split("=")[0]}"' not in source]
    if tool != "megatron-alp":
        return problems
    args = [w for w in args if w != "--debug"]
    if not args or args[0] in ("--version", "--help", "-h"):
        return problems
    if args[0] not in COMMANDS:
        return problems + [f"no command megatron-alp {args[0]}"]
    parser, _ = command_parser(args[0])
    options = _options(parser)
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subparsers and len(args) > 1:
        if args[1] not in subparsers[0].choices:
            return problems + [f"no command megatron-alp {args[0]} {args[1]}"]
        options = _options(subparsers[0].choices[args[1]])
    return problems + [f"megatron-alp {args[0]} has no option {w.split('=')[0]}" for w in args
                       if w.startswith("--") and w.split("=")[0] not in options]


def test_quoted_commands_options_and_keys_are_current():
    stale, commands = [], 0
    for page in PAGES_QUOTING:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for line in _shell_lines(text):
            problems = command_problems(line)
            commands += 1
            stale += [f"{name}: `{line}`: {p}" for p in problems]
        stale += [f"{name}: `{piece}`: {p}" for piece in _inline_keys(text) if (p := key_problem(piece))]
    assert commands > 40, commands  # the pages quote commands, and the parser finds them
    assert not stale, "\n".join(stale)


def test_the_check_catches_a_renamed_flag_and_key():
    """The checker itself, on lines a stale page would hold."""
    assert command_problems("megatron-alp plan configs/quickstart_cpu.yaml --gpus 8") == []
    assert command_problems("megatron-alp plan configs/quickstart_cpu.yaml --gpu 8") == [
        "megatron-alp plan has no option --gpu"]
    assert command_problems("megatron-alp convert quantize --mcore X --format fp8 --calibration D") == [
        "megatron-alp convert has no option --calibration"]
    assert command_problems("python benchmarks/compare_methods.py --arm grpo") == [
        "benchmarks/compare_methods.py has no option --arm"]
    assert command_problems(".venv/bin/megatron-alp train configs/quickstart_cpu.yaml trainer.max_stale=1") == [
        "trainer.max_stale=1: no config key trainer.max_stale"]
    assert key_problem("rollout.sync_delta") is None and key_problem("rollout.sync_delta_anchor: 10") is None
    assert key_problem("perturbation.calibration_mode: per_layer_added") is None
    assert key_problem("perturbation.calibration_mode: per_layer_sum") is not None
    assert key_problem("rollout.offload_*") is None and key_problem("trainer.py") is None
    assert key_problem("rollout.sync_delta_every") == "no config key rollout.sync_delta_every"
