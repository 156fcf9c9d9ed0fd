"""A memory cgroup for each execution: the bound on everything an execution can pin in memory.

``RLIMIT_AS`` bounds one process's address space, not pages that outlive a mapping: System V shared
memory after ``shmdt``, ``memfd`` and tmpfs files, kernel objects. A memory cgroup charges all of
them to the execution that touched them. Each worker slot of the executor gets its own group under a
directory the executor makes in its own cgroup, with ``memory_mb + disk_mb`` of memory, no swap
(where the kernel accounts swap) and a process count; the executor moves each execution's first
process into its slot's group before handing it the code, so everything the code does is charged
there. One execution runs in a slot at a time, and a slot's group lives as long as the executor: a
group made and removed per execution would stay in the kernel, dying but not dead, for as long as
the page cache of host files that execution read first stays charged to it.

cgroup v2 needs the memory controller available to this process's cgroup (``memory`` in its
``cgroup.controllers``) and the cgroup writable: :func:`delegate` enables it for the children, moving
the cgroup's processes into a leaf first where the kernel requires it; cgroup v1 needs a writable
``memory`` hierarchy (and uses the ``pids`` hierarchy where one is writable). Where neither is, the
executor refuses full isolation unless ``tir.sandbox.allow_no_memory_cgroup`` accepts the weaker
bound that ``docs/sandbox.md`` describes, and says which holds in its start-up line.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from typing import Optional

_RMDIR_TIMEOUT_S = 5.0
TRAINER_LEAF = "alp-trainer"  # cgroup v2: where the processes of the trainer's cgroup move (:func:`delegate`)
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


def delegate(base: str) -> None:
    """Enable the memory and pids controllers for the children of ``base`` (cgroup v2). The kernel
    refuses that while ``base`` holds processes of its own (the no-internal-process rule), as where the
    trainer runs in a container's or a job's own cgroup: then every process of ``base`` (the trainer's,
    and whatever else runs there) first moves into a leaf, ``base/alp-trainer``, and the executors'
    groups become its siblings."""
    control = os.path.join(base, "cgroup.subtree_control")
    with open(control) as f:
        enabled = f.read().split()
    missing = [c for c in ("memory", "pids") if c not in enabled]
    for attempt in range(3):  # a process may be started in ``base`` meanwhile
        if not missing:
            return
        try:
            _write(control, " ".join("+" + c for c in missing))
            return
        except OSError as err:
            if err.errno != errno.EBUSY or attempt == 2:
                raise
        leaf = os.path.join(base, TRAINER_LEAF)
        os.makedirs(leaf, exist_ok=True)
        with open(os.path.join(base, "cgroup.procs")) as f:
            pids = f.read().split()
        for pid in pids:
            try:
                _write(os.path.join(leaf, "cgroup.procs"), pid)
            except ProcessLookupError:
                pass  # it has exited


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
        self.groups: list[ExecutionGroup] = []
        accounting = "memory.swap.max" if version == "v2" else "memory.memsw.limit_in_bytes"
        self.swap_bounded = os.path.exists(os.path.join(parents["v2" if version == "v2" else "memory"], accounting))

    def swap(self) -> str:
        """What the groups bound of swap, for the start-up line."""
        if self.swap_bounded or not _swap_on():
            return "no swap"
        return "swap NOT bounded (this kernel does not account swap to cgroups: boot with swapaccount=1 or turn swap off)"

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
            if os.path.basename(base) == TRAINER_LEAF:  # moved there by an executor before
                base = os.path.dirname(base)
            try:
                delegate(base)
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
        """A worker slot's group, removed by :meth:`close`."""
        name = f"exec-{next(_ids)}"
        dirs = {h: os.path.join(parent, name) for h, parent in self.parents.items()}
        group = ExecutionGroup(self.version, dirs)
        try:
            for d in dirs.values():
                os.mkdir(d, 0o755)
            if self.version == "v2":
                d = dirs["v2"]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if self.swap_bounded:
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_tasks))
            else:
                d = dirs["memory"]
                _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
                if self.swap_bounded:
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                if "pids" in dirs:
                    _write(os.path.join(dirs["pids"], "pids.max"), str(max_tasks))
        except BaseException:
            group.remove()
            raise
        self.groups.append(group)
        return group

    def close(self) -> None:
        for group in self.groups:
            group.remove()
        for parent in self.parents.values():
            _rmdir(parent)


class ExecutionGroup:
    """One execution's groups (one per hierarchy)."""

    def __init__(self, version: str, dirs: dict[str, str]):
        self.version, self.dirs = version, dirs

    def attach(self, pid: int) -> None:
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def busy(self) -> bool:
        """Whether tasks still count in the group: a process of an execution killed from outside may
        stay a zombie, re-parented to the host's init, for as long as that init does not reap it."""
        d = self.dirs.get("v2") or self.dirs.get("pids")
        try:
            if d is not None:
                with open(os.path.join(d, "pids.current")) as f:
                    return int(f.read()) > 0
            with open(os.path.join(self.dirs["memory"], "cgroup.procs")) as f:
                return bool(f.read().strip())
        except (OSError, ValueError):
            return False

    def oom_kills(self) -> int:
        """How many processes of this group the kernel has killed for memory, ever."""
        d = self.dirs.get("v2") or self.dirs["memory"]
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(d, name)) as f:
                fields = dict(line.split() for line in f if line.strip())
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        for d in self.dirs.values():
            _rmdir(d)


def _swap_on() -> bool:
    try:
        with open("/proc/swaps") as f:
            return len(f.read().splitlines()) > 1
    except OSError:
        return False


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
