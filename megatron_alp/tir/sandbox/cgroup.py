"""One memory cgroup per execution: the bound on everything an execution can pin in memory.

``RLIMIT_AS`` bounds one process's address space, not pages that outlive a mapping: System V shared
memory after ``shmdt``, ``memfd`` and tmpfs files, kernel objects. A memory cgroup charges all of
them to the execution that touched them. Each execution gets its own group under a directory this
executor makes in its own cgroup, with ``memory_mb + disk_mb`` of memory, no swap and a process
count; the executor moves the execution's first process into it before handing it the code, so
everything the code does is charged there.

cgroup v2 needs the memory controller delegated to this process's cgroup (``memory`` in its
``cgroup.subtree_control``, or enabling it there works); cgroup v1 needs a writable ``memory``
hierarchy (and uses the ``pids`` hierarchy where one is writable). Where neither is, the executor
uses the weaker mechanism that ``docs/sandbox.md`` describes, and says so in its start-up line.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from typing import Optional

_RMDIR_TIMEOUT_S = 5.0
_ids = itertools.count()


def _mounts() -> dict[str, tuple[str, str]]:
    """``v2`` and each v1 controller (``memory``, ``pids``) -> (mount point, root inside the hierarchy)."""
    found: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields, (fstype, _source, options) = left.split(), right.split()
            if fstype == "cgroup2":
                found.setdefault("v2", (fields[4], fields[3]))
            elif fstype == "cgroup":
                for controller in set(options.split(",")) & {"memory", "pids"}:
                    found.setdefault(controller, (fields[4], fields[3]))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``v2`` and each v1 controller."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and not controllers:
                paths["v2"] = path
            for controller in controllers.split(","):
                paths.setdefault(controller, path)
    return paths


def _directory(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return os.path.normpath(os.path.join(point, relative))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_parent(directory: str) -> str:
    """This executor's directory; first removes those of executors whose process died (killed,
    it could not remove them)."""
    for name in os.listdir(directory):
        if name.startswith("alp-sandbox-") and not os.path.exists(f"/proc/{name.split('-')[2]}"):
            stale = os.path.join(directory, name)
            for path in [os.path.join(stale, c) for c in os.listdir(stale) if c.startswith("exec-")] + [stale]:
                try:
                    os.rmdir(path)  # once: a group still in use stays
                except OSError:
                    pass
    parent = os.path.join(directory, f"alp-sandbox-{os.getpid()}-{next(_ids)}")
    os.mkdir(parent, 0o755)
    return parent


class ExecutionCgroups:
    """Makes, fills and removes the per-execution groups; :meth:`find` picks the hierarchy."""

    def __init__(self, version: str, parents: dict[str, str]):
        self.version = version  # "v2" or "v1"
        self.parents = parents  # hierarchy ("v2", "memory", "pids") -> this executor's directory

    @classmethod
    def find(cls) -> tuple[Optional["ExecutionCgroups"], str]:
        """The cgroups this machine lets this process make, or None; and a line saying which or why not."""
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError as err:
            return None, f"no cgroups ({err})"
        reasons = []
        if "v2" in mounts and "v2" in own:
            base = _directory(mounts["v2"], own["v2"])
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                missing = [c for c in ("memory", "pids") if c not in enabled]
                if missing:
                    _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in missing))
                parent = _make_parent(base)
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
                return cls("v2", {"v2": parent}), f"cgroup v2 under {base}"
            except OSError as err:
                reasons.append(f"cgroup v2 at {base}: {err.strerror or err}")
        if "memory" in mounts and "memory" in own:
            base = _directory(mounts["memory"], own["memory"])
            try:
                parents = {"memory": _make_parent(base)}
            except OSError as err:
                reasons.append(f"cgroup v1 memory at {base}: {err.strerror or err}")
            else:
                if "pids" in mounts and "pids" in own:
                    try:
                        parents["pids"] = _make_parent(_directory(mounts["pids"], own["pids"]))
                    except OSError:
                        pass  # RLIMIT_NPROC still bounds the processes
                return cls("v1", parents), f"cgroup v1 under {base}"
        return None, "; ".join(reasons) or "no cgroup hierarchy with a memory controller"

    def create(self, memory_bytes: int, max_tasks: int) -> "ExecutionGroup":
        name = f"exec-{next(_ids)}"
        dirs = {h: os.path.join(parent, name) for h, parent in self.parents.items()}
        group = ExecutionGroup(self.version, dirs)
        try:
            for d in dirs.values():
                os.mkdir(d, 0o755)
            if self.version == "v2":
                d = dirs["v2"]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_tasks))
            else:
                d = dirs["memory"]
                _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                if "pids" in dirs:
                    _write(os.path.join(dirs["pids"], "pids.max"), str(max_tasks))
        except BaseException:
            group.remove()
            raise
        return group

    def close(self) -> None:
        for parent in self.parents.values():
            _rmdir(parent)


class ExecutionGroup:
    """One execution's groups (one per hierarchy)."""

    def __init__(self, version: str, dirs: dict[str, str]):
        self.version, self.dirs = version, dirs

    def attach(self, pid: int) -> None:
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this group for memory."""
        d = self.dirs.get("v2") or self.dirs["memory"]
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(d, name)) as f:
                fields = dict(line.split() for line in f if line.strip())
        except OSError:
            return False
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for d in self.dirs.values():
            _rmdir(d)


def _rmdir(path: str) -> None:
    """Remove a group once its processes are gone (they may take a moment to leave it)."""
    deadline = time.monotonic() + _RMDIR_TIMEOUT_S
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                return
            time.sleep(0.01)
