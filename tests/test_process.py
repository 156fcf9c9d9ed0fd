"""Process hygiene (megatron_alp/runtime/process.py): a process tree that ends with the process above it, and
the shared memory it leaves."""

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import running

from megatron_alp.runtime.process import clean_shared_memory_after

# A "rank" that starts a child watching it, prints the child's pid, and waits to be killed.
RANK = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""
CHILD = """
import os, signal, sys, time
from megatron_alp.runtime.process import end_with_parent
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
end_with_parent(os.getppid(), grace_s=1.0, poll_s=0.05)
print(os.getpid(), flush=True)
time.sleep(60)
"""



@pytest.mark.parametrize("on_sigterm", ["exit", "ignore"])
def test_a_child_ends_when_its_parent_is_killed(on_sigterm):
    """SIGKILL the parent: the child gets SIGTERM at once, and SIGKILL after the grace period when
    it ignores that."""
    rank = subprocess.Popen([sys.executable, "-c", RANK, CHILD, on_sigterm], stdout=subprocess.PIPE, text=True)
    try:
        child = int(rank.stdout.readline())
        time.sleep(0.3)
        assert running(child)
    finally:
        rank.kill()
        rank.wait()
    t0 = time.monotonic()
    while running(child) and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    took = time.monotonic() - t0
    assert not running(child)
    assert took < 1.0 if on_sigterm == "exit" else 1.0 <= took < 5.0, took


def test_a_child_whose_origin_is_gone_already_ends_at_once():
    """The process that started the tree died before the watch began (its pid is no longer in use)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = f"from megatron_alp.runtime.process import end_with_parent; import time; end_with_parent({gone.pid}); time.sleep(60)"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 5


# Maps a shared-memory segment (created, or opened by name) and waits to be killed.
HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
name = sys.argv[1] if len(sys.argv) > 1 else None
shm = shared_memory.SharedMemory(name=name, create=name is None, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's readers: the tracker must not clean up
print(shm.name, flush=True)
time.sleep(60)
"""


def _hold(*name: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *name], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _gone(path: Path, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


def test_a_killed_process_leaves_no_shared_memory_that_nobody_uses():
    """A SIGKILLed process cannot unlink its /dev/shm segments; its janitor does, once no live
    process maps them any more: not while a reader still does, and at once after the reader ends."""
    creator, name = _hold()
    reader, same = _hold(name)
    path = Path("/dev/shm") / name
    try:
        assert same == name and path.exists()
        clean_shared_memory_after(creator.pid)
        clean_shared_memory_after(reader.pid)
        time.sleep(1.0)  # both janitors have seen the mapping
        creator.kill()
        creator.wait()
        assert not _gone(path, timeout=3.0), "unlinked while the reader still maps it"
        reader.kill()
        reader.wait()
        assert _gone(path), f"{path} outlived every process that mapped it"
    finally:
        for proc in (creator, reader):
            proc.kill()
            proc.wait()
        path.unlink(missing_ok=True)


# Maps a file inside a folder of /dev/shm, as an engine maps the folder transport's synced weights.
MAPPER = """
import mmap, sys, time
with open(sys.argv[1], "r+b") as f:
    view = mmap.mmap(f.fileno(), 0)
print("mapped", flush=True)
time.sleep(60)
"""


def test_a_killed_process_leaves_the_files_of_a_shm_folder_to_its_owner(tmp_path):
    """The synced weights an engine maps from a /dev/shm folder outlive the engine's kill: its restart
    reads them again (the folder's owner removes them), so its janitor must leave them."""
    folder = Path(tempfile.mkdtemp(prefix="alp-test-", dir="/dev/shm"))
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\0" * (1 << 16))
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(weights)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        clean_shared_memory_after(proc.pid)
        time.sleep(1.0)  # the janitor has seen the mapping
        proc.kill()
        proc.wait()
        time.sleep(1.5)  # the janitor has ended and removed what was its to remove
        assert weights.exists()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
