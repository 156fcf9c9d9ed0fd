"""Process hygiene: children that die with their parent, and the shared memory they leave."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_forking_parent = None
_janitored: set[int] = set()  # pids that have a shared-memory janitor


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


def end_with_parent(origin: int, grace_s: float = 5.0, poll_s: float = 0.5) -> None:
    """End this process when its parent ends, or when process ``origin`` (the one that started the
    tree this process belongs to) is gone already: SIGTERM to itself first (vLLM's engine core
    handles it by stopping its workers and freeing its shared memory), SIGKILL ``grace_s`` later.

    A daemon thread watches ``os.getppid()``, which changes the moment the parent exits (the
    process is re-parented), so each level of a tree follows the one above it. Not
    ``PR_SET_PDEATHSIG``: its "parent" is the thread that started the process, and an engine
    restarted from a rank's short-lived thread would die with that thread."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and alive(origin):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="megatron-alp-end-with-parent", daemon=True).start()


def clean_shared_memory_after(pid: int) -> None:
    """Start a janitor (:mod:`megatron_alp.runtime.shm_janitor`) that unlinks the /dev/shm segments
    process ``pid`` maps once it has ended and nobody else maps them. It runs in its own session
    with an empty environment, so the kill of a job's process group or of every process carrying
    the job's variables spares it; it ends seconds after ``pid``."""
    if pid in _janitored:
        return
    _janitored.add(pid)
    janitor = Path(__file__).with_name("shm_janitor.py")
    subprocess.Popen([sys.executable, "-S", str(janitor), str(pid)], env={}, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     close_fds=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie, not yet reaped, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
