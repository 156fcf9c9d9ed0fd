"""A config file or dict -> the schema-validated :class:`~megatron_alp.config.schema.Config`:
YAML, ``a.b.c=value`` overrides, and errors that name each offending key by its dotted path.

A config read here is not resolved yet: :func:`megatron_alp.resolve.load_config` reads it and
resolves it, which is what commands and runs use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from megatron_alp.config.schema import Config, ConfigError


def format_errors(errors: list[tuple[str, str, Any]], source: str) -> str:
    """One line per ``(dotted key, message, value)``, under ``invalid configuration in SOURCE``;
    the value is shown unless it is a section, a list or absent (``...``)."""
    lines = [f"invalid configuration in {source}:"]
    for key, msg, got in errors:
        shown = got is not ... and not isinstance(got, (dict, list))
        lines.append(f"  {key}: {msg} (got {got!r})" if shown else f"  {key}: {msg}")
    return "\n".join(lines)


def _schema_errors(err: ValidationError) -> list[tuple[str, str, Any]]:
    out = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (see docs/configuration.md for the valid keys)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        out.append((key, msg, ... if e["type"] == "missing" else e.get("input")))
    return out


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. loss.name=alp_seq")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    """The raw mapping of a YAML config file (ConfigError naming the file otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return data


def validate_schema(data: dict, source: str = "<dict>") -> Config:
    """A raw dict checked against the schema (not resolved), raising :class:`ConfigError` naming
    each key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(_schema_errors(err), source)) from None


def read_config(path: str | Path, overrides: Optional[list[str]] = None) -> Config:
    """A YAML config file with command-line overrides, checked against the schema (not resolved)."""
    return validate_schema(apply_overrides(read_yaml(path), overrides or []), str(path))
