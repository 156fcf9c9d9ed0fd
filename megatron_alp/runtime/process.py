"""Process hygiene: children that die with their parent."""

from __future__ import annotations

import ctypes
import os
import signal

_forking_parent = None


def forks_die_with_their_parent() -> None:
    """Every child forked (not exec'd) from this process from now on, and from its forked children,
    is killed when its parent dies. Megatron's checkpoint save forks a writer per bucket; a trainer
    killed during a save would otherwise leave those copies of itself blocked on a pipe forever,
    holding its memory and open files."""
    libc = ctypes.CDLL(None, use_errno=True)

    def before():
        global _forking_parent
        _forking_parent = os.getpid()

    def in_child():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != _forking_parent:  # the parent died before the line above
            os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)
