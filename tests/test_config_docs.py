"""docs/configuration.md is generated from the config classes and the loss registry, and is current."""

import re
from pathlib import Path

from megatron_alp.algorithms.policy_loss import POLICY_LOSSES
from megatron_alp.cli import main as cli_main
from megatron_alp.commands.config_docs import config_docs

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_docs_up_to_date(tmp_path):
    """docs/configuration.md is generated; regenerate with `megatron-alp config-docs --out docs/configuration.md`."""
    out = tmp_path / "configuration.md"
    assert cli_main(["config-docs", "--out", str(out)]) == 0
    assert out.read_text() == config_docs()
    assert (ROOT / "docs" / "configuration.md").read_text() == config_docs(), (
        "docs/configuration.md is stale: run `megatron-alp config-docs --out docs/configuration.md`")


def test_docs_list_every_registered_loss():
    text = config_docs()
    for name, spec in POLICY_LOSSES.items():
        assert f"| `{name}` | {spec.paper} |" in text, name


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
