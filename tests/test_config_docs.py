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


def test_loss_knob_groups_name_registered_losses():
    """Each loss's own knobs sit under a `# read by:` comment in the loss section (config cannot
    import the registry); a renamed or removed loss must not leave a stale name there."""
    text = (ROOT / "megatron_alp" / "config" / "sections" / "loss.py").read_text()
    groups = re.findall(r"# read by: ([^;\n]+)", text)
    assert groups
    for group in groups:
        assert {n.strip() for n in group.split(",")} <= set(POLICY_LOSSES), group
