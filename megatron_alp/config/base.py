"""What every config section shares, in a module of its own so that the sections and the root
:class:`~megatron_alp.config.schema.Config` that composes them can both import it: the strict
section base and the errors a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class InputError(ValueError):
    """Bad user input (a config key, a file, an argument): the command line prints the message
    alone and exits with status 2, with no traceback. The message names what was wrong and what
    was expected."""


class ConfigError(InputError):
    """A configuration file or override is invalid; the message names each offending key."""


class _Section(BaseModel):
    """A section refuses keys it does not declare (a typo is an error, not a silent default) and
    checks assignments too, so the defaults resolution sets stay within each key's range."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
