"""The user's terminal during a run: the project's own lines and the progress bar; all engine and
library output goes to a log file in the run directory.

Engines and libraries write to file descriptors 1 and 2 from Python (vLLM's loggers, warnings),
from C++ (torch, gloo, vLLM's CPU kernels) and from child processes (vLLM's engine core), so the
only redirection that catches all of it is at the descriptor level: inside
:func:`library_output_to`, descriptors 1 and 2 point at the log and this module keeps duplicates
of the terminal for :func:`say` and :func:`progress_stream`. Leaving the context, normally or by
an exception, restores the terminal first, so errors and tracebacks are shown there.

Warnings raised before the log exists (Megatron-Core's and the engines' import-time warnings, while
the CLI imports a command or the command validates its config) are held (:func:`held_warnings`)
and written to the log when it opens.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, TextIO

_out: Optional[TextIO] = None  # the terminal's stdout while library output is redirected
_err: Optional[TextIO] = None  # the terminal's stderr (progress bar)
_held: list = []  # warnings waiting for the log


def say(message: str) -> None:
    """One line of ours for the user (the terminal, also while library output is redirected)."""
    print(message, file=_out or sys.stdout, flush=True)


def say_error(message: str) -> None:
    """One error line of ours on the terminal's stderr (also while library output is redirected)."""
    print(message, file=_err or sys.stderr, flush=True)


def progress_stream() -> TextIO:
    """Where a progress bar draws: the terminal's stderr."""
    return _err or sys.stderr


def log_name() -> str:
    """``engine.log`` for global rank 0 (torchrun's ``RANK``), ``engine.rank<N>.log`` for the others."""
    rank = int(os.environ.get("RANK", "0"))
    return "engine.log" if rank == 0 else f"engine.rank{rank}.log"


@contextmanager
def held_warnings() -> Iterator[None]:
    """Hold the warnings raised in the block for the next :func:`library_output_to` log."""
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("default")
        yield
    _held.extend(held)


@contextmanager
def library_output_to(path: Path) -> Iterator[Path]:
    """Send everything written to descriptors 1 and 2 (by this process and the processes it starts)
    to ``path`` (appended) for the duration; :func:`say` and the progress bar still reach the terminal."""
    global _out, _err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    _err = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    while _held:
        w = _held.pop(0)
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _out.close()
        _err.close()
        _out = _err = None
