"""The confinement program: a fresh interpreter runs it for every execution (the executor,
:mod:`.executor`, starts ``python -I -S`` and hands it this program, compiled, then a spec
(marshalled, after its length) and the code on stdin). It confines itself, checks that it has every protection the executor's
start-up probe had, then execs another fresh interpreter that runs the code like a notebook cell
(:mod:`.cell`), so that the code's process never held the spec or anything of the set-up.

Standard library only, and no ``site`` (site-packages, and the ``.pth`` files in them, are loaded by
the interpreter that runs the code, confined), so nothing from the environment runs with the
privileges the set-up needs.

Isolated mode, as processes:

* the outer process (root, or an unprivileged uid that creates a user namespace) unshares the
  mount, PID, network, IPC, UTS and cgroup namespaces and forks
* init, pid 1 of the new PID namespace, which names the host ``sandbox``, builds a private root
  file system (read-only views of the system and Python directories, the virtual environment at a
  neutral path, a fresh ``/proc`` with the kernel's key and debugging files masked, a size-limited
  tmpfs at ``/sandbox``, also ``/tmp``),
  pivots into it, forks the worker, drops its own capabilities and reports the worker's exit
  status. When init dies the kernel kills every process of the namespace, and the tmpfs goes with
  the namespace;
* the worker starts a session of its own (``kill(0, ...)`` reaches only the code's processes),
  drops to an unprivileged uid without capabilities, sets ``no_new_privs`` and resource limits,
  loads the seccomp filter (:mod:`.syscall_filter`) and execs the interpreter that runs the code
  (all of these hold across the exec).

Each process is killed when its parent dies (``PR_SET_PDEATHSIG``), so killing the trainer
takes every execution with it. In unsafe mode the started process is the worker itself (already
switched to an unprivileged uid by the executor when the trainer is root).

Status lines (Python literals) go to the status descriptor: ``init`` (its pid, from the outer process),
``protections`` (the worker, once confined, before the code runs; the descriptor closes on the
exec), ``exit`` (init: the worker's exit status) or ``setup_error`` with ``missing`` (the
capability that failed).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import signal
import sys

SANDBOX_DIR = "/sandbox"
# Where the new root is built, in the execution's own mount namespace: a directory every system has
# and that holds nothing the sandbox binds, so an execution creates nothing on the host's disk.
NEW_ROOT = "/sys"
EXIT_SETUP_FAILED = 70

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME = 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_CAPBSET_DROP = 1, 4, 22, 24
_PR_SET_NO_NEW_PRIVS, _SECCOMP_MODE_FILTER = 38, 2
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
# /proc entries that show kernel-wide state (keyrings of every uid, kernel memory, timers) or
# that write to the kernel: hidden behind /dev/null or an empty read-only tmpfs, or made read-only.
_MASKED_FILES = ("keys", "key-users", "kcore", "kallsyms", "timer_list", "sched_debug", "latency_stats",
                 "sysrq-trigger", "kmsg", "cmdline")
_MASKED_DIRS = ("acpi", "scsi", "asound", "pressure")
# What the code sees instead of files that identify the host or show what else runs on it: in /etc
# (replaced where the host has them) and in /proc (a new boot id per execution, no load).
_OWN_ETC = {"hostname": "sandbox\n", "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tsandbox\n",
            "resolv.conf": "", "machine-id": None}
_OWN_PROC = {"loadavg": "0.00 0.00 0.00 1/1 1\n", "sys/kernel/random/boot_id": None}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_READ_ONLY_DIRS = ("sys", "irq", "bus", "fs")


class SetupError(Exception):
    """A confinement step failed; ``missing`` names the capability the machine lacks."""

    def __init__(self, missing: str, err: BaseException):
        super().__init__(f"{missing}: {type(err).__name__}: {err}")
        self.missing = missing


def _step(missing: str, fn, *args):
    try:
        return fn(*args)
    except (OSError, ValueError) as err:
        raise SetupError(missing, err) from None


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_LIBC.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _kept_flags(path: str) -> int:
    """Mount flags of ``path`` that a user namespace may not clear on remount (they are locked)."""
    st = os.statvfs(path)
    flags = 0
    for st_flag, ms_flag in ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
                             (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME),
                             (os.ST_RELATIME, _MS_RELATIME)):
        if st.f_flag & st_flag:
            flags |= ms_flag
    return flags


def _bind_read_only(src: str, target: str) -> None:
    _mount(src, target, None, _MS_BIND | _MS_REC)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _kept_flags(target))


def _unescape(field: bytes) -> str:
    """A path as /proc/self/mountinfo writes it (space, tab, newline and backslash in octal)."""
    for code, char in ((b"\\040", b" "), (b"\\011", b"\t"), (b"\\012", b"\n"), (b"\\134", b"\\")):
        field = field.replace(code, char)
    return os.fsdecode(field)


def _remount_submounts_read_only(targets: list[str]) -> None:
    """A recursive bind keeps the source's submounts writable: make those read-only too."""
    with open("/proc/self/mountinfo", "rb") as f:  # this task's mount namespace: the one being built
        points = [_unescape(line.split()[4]) for line in f]
    for point in points:
        if any(point.startswith(t + "/") for t in targets):
            _mount(None, point, None,
                   _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _kept_flags(point))


def report(status_fd: int, **message) -> None:
    """A status line: the message as a Python literal (``repr``; no ``json``, which would import ``re``
    in every execution), read back with ``ast.literal_eval``."""
    os.write(status_fd, (repr(message) + "\n").encode())


def _die_with_parent(parent_alive) -> None:
    """SIGKILL this process when its parent dies; exit now if that already happened."""
    _check(_LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if not parent_alive():
        os._exit(EXIT_SETUP_FAILED)


# --------------------------------------------------------------------------- isolated mode


def _unshare(spec: dict) -> list[str]:
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP
    active = ["mount_namespace", "pid_namespace", "net_namespace", "ipc_namespace", "uts_namespace",
              "cgroup_namespace"]
    if spec["user_namespace"]:
        uid, gid = os.getuid(), os.getgid()  # kept inside: an unprivileged uid there too
        _step("unprivileged user namespaces", lambda: _check(_LIBC.unshare(flags | _CLONE_NEWUSER), "unshare"))

        def map_ids():
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)

        _step("a uid mapping for the user namespace", map_ids)
        active.append("user_namespace")
    else:
        _step("Linux namespaces (unshare as root)", lambda: _check(_LIBC.unshare(flags), "unshare"))
    return active


def _build_root(spec: dict) -> list[str]:
    """In the new mount namespace: a tmpfs root (over /sys, which stays as it is outside) holding
    read-only binds of the system and Python directories, device nodes, a fresh /proc and the
    size-limited tmpfs /sandbox; pivot into it and make the root read-only."""
    root = NEW_ROOT
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    targets = []
    for path in spec["ro_binds"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
            continue
        os.makedirs(target, exist_ok=True)
        _bind_read_only(path, target)
        targets.append(target)
    _remount_submounts_read_only(targets)
    active = ["private_proc", "private_tmpfs", "disk_quota"]
    if spec["venv"]:
        active += _mount_venv(root, *spec["venv"], spec["venv_masks"], spec["venv_links"])
    os.makedirs(root + "/dev")
    for dev in _DEVICES:  # read-only binds: nothing about the host's nodes (times, modes) can change
        if os.path.exists("/dev/" + dev):
            open(root + "/dev/" + dev, "w").close()
            _mount("/dev/" + dev, root + "/dev/" + dev, None, _MS_BIND)
            _mount(None, root + "/dev/" + dev, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC
                   | (_kept_flags(root + "/dev/" + dev) & ~_MS_NODEV))
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _mask_proc(root)
    for name, text in _OWN_ETC.items():  # a link (to /run, say) dangles inside: nothing to cover
        if os.path.isfile(root + "/etc/" + name) and not os.path.islink(root + "/etc/" + name):
            _cover(root, root + "/etc/" + name, text)
    os.makedirs(root + SANDBOX_DIR)
    owner = spec["uid"] if spec["uid"] is not None else os.getuid()
    size = (f"size={spec['disk_mb']}m,nr_inodes={spec['disk_mb'] * 256},mode=700,"
            f"uid={owner},gid={owner}")
    _mount("tmpfs", root + SANDBOX_DIR, "tmpfs", _MS_NOSUID | _MS_NODEV, size)
    os.symlink(SANDBOX_DIR, root + "/tmp")
    os.chdir(root)
    nr = _SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
    if nr is not None:
        _check(_LIBC.syscall(nr, b".", b"."), "pivot_root")
        _check(_LIBC.umount2(b".", _MNT_DETACH), "umount old root")
    else:
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    return active


def _mount_venv(root: str, host: str, neutral: str, masks: dict, links: dict) -> list[str]:
    """The virtual environment, read-only at ``neutral``: through an overlay whose only layer
    is a bind that is detached at once, so /proc/self/mountinfo names neither the host path nor
    the directory holding it (a bind's mount root would); a plain bind where overlays are not
    available. Files that name those paths are replaced by ``masks``, and its ``bin`` (scripts
    whose first line names the host path, ``activate``) by the interpreter's ``links`` alone."""
    lower, target = root + "/.lower", root + neutral
    os.makedirs(lower + "/venv")
    os.makedirs(lower + "/empty")
    os.makedirs(target)
    _bind_read_only(host, lower + "/venv")
    try:
        _mount("overlay", target, "overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
               f"lowerdir={lower}/venv:{lower}/empty")
        active = ["host_paths_hidden"]
    except OSError:
        _bind_read_only(host, target)
        active = []
    _check(_LIBC.umount2((lower + "/venv").encode(), _MNT_DETACH), "umount the staging bind")
    for i, (relative, text) in enumerate(sorted(masks.items())):
        replacement = f"{lower}/mask-{i}"
        with open(replacement, "w") as f:
            f.write(text)
        _mount(replacement, f"{target}/{relative}", None, _MS_BIND)
        _mount(None, f"{target}/{relative}", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    if os.path.isdir(target + "/bin"):
        _mount("tmpfs", target + "/bin", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16k,nr_inodes=64,mode=755")
        for name, link in links.items():
            os.symlink(link, f"{target}/bin/{name}")
        _mount(None, target + "/bin", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    return active


def _cover(root: str, target: str, text) -> None:
    """Bind a read-only file of ``text`` (None: a new random id) over ``target``."""
    os.makedirs(root + "/.own", exist_ok=True)
    source = f"{root}/.own/{len(os.listdir(root + '/.own'))}"
    with open(source, "w") as f:
        f.write(os.urandom(16).hex() + "\n" if text is None else text)
    _mount(source, target, None, _MS_BIND)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def _mask_proc(root: str) -> None:
    proc = root + "/proc/"
    for name in _MASKED_FILES:
        if os.path.isfile(proc + name):
            _mount(root + "/dev/null", proc + name, None, _MS_BIND)
    for name, text in _OWN_PROC.items():
        if os.path.isfile(proc + name):
            _cover(root, proc + name, text)
    for name in _MASKED_DIRS:
        if os.path.isdir(proc + name):
            _mount("tmpfs", proc + name, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k")
    for name in _READ_ONLY_DIRS:
        if os.path.isdir(proc + name):
            _bind_read_only(proc + name, proc + name)


def _would_block(fd: int) -> bool:
    try:
        os.read(fd, 1)
    except BlockingIOError:
        return True
    return False


def _run_init(worker: int, status_fd: int) -> None:
    """pid 1 of the namespace: without privileges from here on, reap until the worker exits,
    report its status, and exit (which kills whatever the code left running)."""
    _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    _clear_capabilities()
    while True:
        pid, status = os.wait()
        if pid == worker:
            report(status_fd, exit=os.waitstatus_to_exitcode(status))
            os._exit(0)


def _isolate(spec: dict, status_fd: int) -> list[str]:
    """Returns in the worker (the other processes never return)."""
    active = _unshare(spec)
    alive_r, alive_w = os.pipe()  # init reads EOF here once the outer process is gone
    init = os.fork()
    if init:
        os.close(alive_r)
        report(status_fd, init=init)
        os.close(status_fd)
        os.waitpid(init, 0)
        os._exit(0)
    os.close(alive_w)
    os.set_blocking(alive_r, False)
    _die_with_parent(lambda: _would_block(alive_r))
    os.close(alive_r)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pid 1 gets only the signals it handles
    _step("a private host name", lambda: _check(_LIBC.sethostname(b"sandbox", 7), "sethostname"))
    active += _step("mounts in a private mount namespace", _build_root, spec)
    worker = os.fork()
    if worker:
        _run_init(worker, status_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()  # kill(0, ...) reaches the code's own processes, never init or the outer process
    return active


# --------------------------------------------------------------------------- every mode


def _clear_capabilities() -> None:
    nr = _SYSCALLS.get(os.uname().machine, {}).get("capset")
    if nr is None:
        raise OSError(0, f"capset: unknown system call number on {os.uname().machine}")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_LIBC.syscall(nr, header, data), "capset")


def _capabilities_left() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["CapPrm"], 16) | int(fields["CapEff"], 16) | int(fields["CapAmb"], 16)


def _drop_privileges(spec: dict) -> list[str]:
    """No capabilities and none to regain; as root, the slot's own unprivileged uid."""
    active = []
    uid = spec["uid"]
    if spec["isolated"]:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        for cap in range(last_cap + 1):
            _check(_LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
        if uid is not None and os.getuid() == 0:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        else:
            _clear_capabilities()
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise OSError(0, "the code would run as uid or gid 0")
    if uid is not None:
        active.append("uid_drop")
    if _capabilities_left():
        raise OSError(0, "capabilities are left after dropping them")
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    return active + ["cap_drop", "no_new_privs"]


def _user_task_count() -> int:
    """Tasks (processes and threads) of this uid: RLIMIT_NPROC counts them all."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count


def _set_limits(spec: dict) -> list[str]:
    """CPU, address space, file size, open files, core dumps, processes; and no locked memory or
    real-time priority, whatever the trainer's limits allow. Core dumps: a limit of 1, not 0, which
    the kernel also reads as "no core" for a ``core_pattern`` that pipes to a helper (that helper would
    run as root on the host)."""
    import math
    import resource

    cpu = max(1, math.ceil(spec["cpu_s"]))
    memory = spec["memory_mb"] << 20
    fsize = spec["file_mb"] << 20
    if spec["user_namespace"]:
        nproc = spec["nproc"] + 2  # the outer process and init count in the namespace too
    elif spec["uid"] is not None:
        nproc = spec["nproc"]  # the slot's uid runs nothing else
    else:  # unsafe mode, the trainer's own uid: what it runs now plus the budget
        nproc = _user_task_count() + spec["nproc"]
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                         (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (1, 1)),
                         (resource.RLIMIT_NOFILE, (256, 256)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                         (resource.RLIMIT_MEMLOCK, (0, 0)), (resource.RLIMIT_RTPRIO, (0, 0))):
        resource.setrlimit(limit, value)
    return ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "rlimit_nofile", "rlimit_nproc"]


def _load_seccomp(program: bytes) -> list[str]:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(_LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "PR_SET_SECCOMP")
    return ["seccomp"]


def _install_audit_hook(workdir: str) -> None:
    """Unsafe mode only: refuse sockets and writes outside the working directory with a clear
    message. Advisory (code can switch it off or call libc through ctypes): it catches mistakes,
    the kernel layers of the isolated mode stop attacks."""
    net_events = frozenset({"socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
                            "socket.sendto", "socket.sendmsg"})
    path_events = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                             "os.symlink", "os.link", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                             "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree"})
    inside_dir = os.path.realpath(workdir) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path) -> bool:
        if isinstance(path, int) or path is None:
            return True
        try:
            p = realpath(fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == "/dev/null" or (p + "/").startswith(inside_dir)

    def hook(event, args):
        if event in net_events:
            raise PermissionError("network access is disabled in the sandbox")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(flags, int) and flags & write_flags) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and not inside(path):
                raise PermissionError(f"writing outside the sandbox directory is not allowed: {path}")
        elif event in path_events:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"changing files outside the sandbox directory is not allowed: {arg}")

    sys.addaudithook(hook)


def _confine(spec: dict, status_fd: int) -> list[str]:
    active = ["empty_env", "process_group_kill", "own_session"]  # unsafe: the executor starts a session
    if spec["isolated"]:
        active += _isolate(spec, status_fd)
        workdir = SANDBOX_DIR
    else:
        active.append("private_cwd")
        workdir = spec["workdir"]
    active += _step("dropping privileges", _drop_privileges, spec)
    active += _step("resource limits", _set_limits, spec)
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    if spec["seccomp"]:
        active += _step("seccomp filters", _load_seccomp, bytes.fromhex(spec["seccomp"]))
    if not spec["isolated"]:
        _install_audit_hook(workdir)
        active.append("audit_hook")
    return active


def _reset_signals() -> None:
    """Signals as a fresh interpreter has them, whatever the trainer blocked or ignored (both are
    inherited across exec)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT) and \
                signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _code_descriptor(data: bytes) -> int:
    """A memfd holding ``data`` (the cell program and the code) for the interpreter that runs the
    code (made before the filter, which refuses memfd_create where no memory cgroup counts it; its
    pages are the execution's)."""
    fd = os.memfd_create("code", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def main() -> None:
    _reset_signals()
    spec = marshal.loads(sys.stdin.buffer.read(int.from_bytes(sys.stdin.buffer.read(4), "little")))
    code = sys.stdin.buffer.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    status_fd = spec["status_fd"]
    try:
        _die_with_parent(lambda: os.getppid() == spec["parent"])
        cell = bytes.fromhex(spec["cell"])
        code_fd = _code_descriptor(cell + code)
        protections = _confine(spec, status_fd)
        missing = sorted(set(spec["required"]) - set(protections))
        if missing:
            raise SetupError("the protections of the start-up probe",
                             OSError(0, f"this execution lacks {', '.join(missing)}: it does not run"))
    except SetupError as err:
        report(status_fd, setup_error=str(err), missing=err.missing)
        os._exit(EXIT_SETUP_FAILED)
    except Exception as err:  # noqa: BLE001 - reported to the executor, which refuses to run code
        report(status_fd, setup_error=f"{type(err).__name__}: {err}", missing="the sandbox set-up")
        os._exit(EXIT_SETUP_FAILED)
    os.set_inheritable(status_fd, False)
    report(status_fd, protections=protections)
    # a fresh interpreter runs the code: nothing of this one (the spec, the set-up) reaches it
    bootstrap = f"import marshal,os,sys;exec(marshal.loads(os.read(int(sys.argv[1]),{len(cell)}))){spec['marker']}"
    try:
        os.execv(spec["executable"], [spec["executable"], "-I", "-u", "-c", bootstrap, str(code_fd)])
    except OSError as err:
        report(status_fd, setup_error=f"starting the interpreter {spec['executable']}: {err}", missing="an interpreter")
        os._exit(EXIT_SETUP_FAILED)


if __name__ == "__main__":
    main()
