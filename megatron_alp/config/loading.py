"""A config file or dict -> the schema-validated :class:`~megatron_alp.config.schema.Config`:
YAML, ``a.b.c=value`` overrides, and errors that name each offending key by its dotted path.

A config read here is not resolved yet: :func:`megatron_alp.resolve.load_config` reads it and
resolves it, which is what commands and runs use.
"""

from __future__ import annotations

import difflib
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


def _section(loc: tuple) -> Optional[type]:
    """The schema class of the section at ``loc`` (None past a non-section)."""
    cls = Config
    for part in loc:
        field = cls.model_fields.get(str(part)) if isinstance(cls, type) and hasattr(cls, "model_fields") else None
        cls = field.annotation if field is not None else None
        if cls is None:
            return None
    return cls


def _unknown_key(loc: tuple) -> str:
    """What to say of an unknown key: the closest known keys of its section, if any are close."""
    section = _section(loc[:-1])
    known = list(section.model_fields) if section is not None and hasattr(section, "model_fields") else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=2, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    hint = " or ".join(f"{prefix + '.' if prefix else ''}{c}" for c in close)
    return "unknown key" + (f"; did you mean {hint}?" if hint else " (see docs/configuration.md for the valid keys)")


def _schema_errors(err: ValidationError, overridden: set[str]) -> list[tuple[str, str, Any]]:
    out = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key(e["loc"])
        elif e["type"] == "missing":
            msg = "required key is missing"
        if key in overridden:
            key = f"{key} (command-line override)"
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


def validate_schema(data: dict, source: str = "<dict>", overridden: frozenset[str] = frozenset()) -> Config:
    """A raw dict checked against the schema (not resolved), raising :class:`ConfigError` naming
    each key (and whether it came from a command-line override: ``overridden``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(_schema_errors(err, set(overridden)), source)) from None


def override_keys(overrides: list[str]) -> frozenset[str]:
    """The dotted keys of ``KEY=VALUE`` overrides."""
    return frozenset(".".join(_parse_override(item)[0]) for item in overrides)


def read_config(path: str | Path, overrides: Optional[list[str]] = None) -> Config:
    """A YAML config file with command-line overrides, checked against the schema (not resolved)."""
    overrides = overrides or []
    return validate_schema(apply_overrides(read_yaml(path), overrides), str(path), override_keys(overrides))
