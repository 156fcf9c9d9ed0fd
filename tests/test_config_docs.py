"""The reference pages of the documentation (docs/configuration.md, docs/reference/) are generated from
the config classes, the registries, the metric catalogue, the phase table and the command parsers, and
are current."""

import re
from pathlib import Path

from megatron_alp.algorithms.policy_loss import POLICY_LOSSES
from megatron_alp.cli import main as cli_main
from megatron_alp.commands import COMMANDS
from megatron_alp.commands.config_docs import PAGES, commands_docs, config_docs, losses_docs, phases_docs
from megatron_alp.plan.phases import PHASES

ROOT = Path(__file__).resolve().parents[1]


def test_generated_pages_up_to_date(tmp_path):
    """Every generated page; regenerate with `megatron-alp config-docs --site docs`."""
    assert cli_main(["config-docs", "--out", str(tmp_path / "configuration.md")]) == 0
    assert (tmp_path / "configuration.md").read_text() == config_docs()
    assert cli_main(["config-docs", "--site", str(tmp_path / "site")]) == 0
    for path, page in PAGES.items():
        text = page()
        assert (tmp_path / "site" / path).read_text() == text
        assert (ROOT / "docs" / path).read_text() == text, (
            f"docs/{path} is stale: run `megatron-alp config-docs --site docs`")


def test_docs_list_every_registered_loss_phase_and_command():
    losses = losses_docs()
    for name, spec in POLICY_LOSSES.items():
        assert f"| `{name}` | {spec.paper} |" in losses, name
    phases = phases_docs()
    for name in PHASES:
        assert f"| `{name}` |" in phases, name
    commands = commands_docs()
    for name in COMMANDS:
        assert f"## `megatron-alp {name}`" in commands, name
    for action in ("hf-to-mcore", "mcore-to-hf", "mcore-to-peft", "reshard", "quantize", "verify"):
        assert f"### `megatron-alp convert {action}`" in commands, action
    assert "| `--gpu-mem` `GPU_MEM` |" in commands  # an option with its value, as --help names it


def test_each_loss_declares_the_keys_of_its_own_that_the_loss_section_groups_under_its_name():
    """A loss's own ``loss.*`` keys are declared twice, each where its wing can see it: with the loss in
    the registry (``knobs=``, for the docs table) and in the loss section under a ``# read by:``
    comment (config cannot import the registry). They must agree, both ways."""
    text = (ROOT / "megatron_alp" / "config" / "sections" / "loss.py").read_text()
    readers: dict[str, set[str]] = {}
    current: set[str] = set()
    for line in text.splitlines():
        comment = re.match(r"\s+# read by: ([^;\n]+)", line)
        field = re.match(r"    (\w+): .*= Field\(", line)
        if comment:
            current = {n.strip() for n in comment.group(1).split(",")}
        elif line.strip().startswith("#"):
            current = set()
        elif field and current:
            readers[field.group(1)] = current
    assert readers and set().union(*readers.values()) <= set(POLICY_LOSSES), readers
    from megatron_alp.config import LossConfig

    for name, loss in POLICY_LOSSES.items():
        assert set(loss.knobs) <= set(LossConfig.model_fields), (name, loss.knobs)
        assert set(loss.knobs) == {key for key, who in readers.items() if name in who}, name
