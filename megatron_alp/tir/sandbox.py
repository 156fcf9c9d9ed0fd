"""A sandboxed Python interpreter for tool-integrated reasoning.

Every execution runs in a fresh interpreter process (this file run as a script) that confines
itself before the model's code runs, then executes it like a notebook cell (the value of a final
expression is printed). Protections, strongest first; each is used when the machine allows it and
:attr:`SandboxExecutor.protections` says which are active:

* ``pid_namespace``, ``net_namespace``, ``mount_namespace``: a private process tree (killing its
  init kills everything the code started), no network interfaces but a downed loopback, and a
  private root file system: a read-only view of the system and Python directories, a fresh
  ``/proc``, a few device nodes, and the execution's directory at ``/sandbox`` (also ``/tmp``) as
  the only writable place. The trainer's files do not exist inside. As root the namespaces are
  created directly; otherwise through an unprivileged user namespace (``user_namespace``).
* ``uid_drop``: as root, the code runs as an unprivileged uid of its own per worker slot (from
  ``SANDBOX_UID_BASE`` up, claimed with a lock file so executors never share one), with no
  supplementary groups.
* ``no_new_privs`` and ``cap_drop``: no capabilities, none regained through setuid binaries.
* ``rlimit_cpu``, ``rlimit_as``, ``rlimit_fsize``, ``rlimit_nofile``, ``rlimit_nproc``: CPU seconds,
  address space, file size, open files and processes (no core dumps either). The kernel does not
  enforce the process limit for the real root, so it is listed only where it holds.
* ``process_group_kill``: the wall-clock limit kills the whole process group (and, as root
  without a PID namespace, every process of the execution's uid).
* ``empty_env``: the trainer's environment is never passed on; the code sees a fixed minimal one.
* ``private_cwd``: a fresh directory per execution, removed afterwards.
* ``audit_hook``: a Python audit hook refuses sockets and writes outside the execution's
  directory. It is defence in depth (code calling libc through ctypes bypasses it), which is why
  the kernel-level protections above matter.

Without root and without user namespaces (e.g. an unprivileged container) only the resource
limits, ``process_group_kill``, ``empty_env``, ``private_cwd``, ``audit_hook`` and ``no_new_privs``
remain; ``sandbox.require_isolation: true`` turns that into a start-up error instead of a warning.
Nothing here raises into the trainer for anything the executed code does: every failure becomes a
:class:`ExecutionResult` whose ``text`` is a clear tool message.
"""

from __future__ import annotations

# The child side runs this file as a script before every execution, so module-level imports are
# kept to what it needs; the parent side imports the rest where it uses it.
import json
import os
import sys

if __name__ != "__main__":  # the parent side
    import select
    import shutil
    import signal
    import subprocess
    import time
    import weakref
    from concurrent.futures import ThreadPoolExecutor
    from queue import SimpleQueue

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from megatron_alp.config import SandboxConfig

SANDBOX_UID_BASE = 61000
SANDBOX_DIR = "/sandbox"

# Fixed environment of the executed code: nothing of the trainer's. HOME/TMPDIR are added in the
# child once its working directory is known.
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_EXIT_SETUP_FAILED = 70

# --------------------------------------------------------------------------- results (parent)


class ExecutionResult:
    """What one execution produced. ``text`` is what the model sees; ``status`` is one of
    ``ok``, ``error`` (exception or non-zero exit), ``timeout`` (wall clock), ``cpu_limit``,
    ``killed`` (another signal) or ``sandbox_error`` (the sandbox itself could not start)."""

    __slots__ = ("text", "status", "exit_code", "truncated", "duration_s", "protections")

    def __init__(self, text: str, status: str, exit_code: "Optional[int]" = None, truncated: bool = False,
                 duration_s: float = 0.0, protections: tuple = ()):
        self.text, self.status, self.exit_code, self.truncated = text, status, exit_code, truncated
        self.duration_s, self.protections = duration_s, tuple(protections)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __repr__(self) -> str:
        return (f"ExecutionResult(status={self.status!r}, exit_code={self.exit_code}, truncated={self.truncated}, "
                f"duration_s={self.duration_s:.3f}, text={self.text[-200:]!r})")


class _OutputBuffer:
    """Keeps the first and last ``limit/2`` bytes of a stream of any length."""

    def __init__(self, limit: int):
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.limit:
                del self.tail[: len(self.tail) - self.limit]

    def text(self) -> tuple[str, bool]:
        if self.total <= self.limit:
            return bytes(self.head).decode("utf-8", "replace"), False
        half = self.limit // 2
        head, tail = bytes(self.head[:half]), bytes((self.head + self.tail)[-half:])
        omitted = self.total - len(head) - len(tail)
        marker = f"\n... [output truncated: {omitted} bytes omitted] ...\n"
        return head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace"), True


def _format_seconds(s: float) -> str:
    return f"{s:g} s"


# --------------------------------------------------------------------------- executor (parent)


class SandboxExecutor:
    """Runs Python code in sandboxed processes, at most ``cfg.workers`` at a time.

    >>> with SandboxExecutor(cfg) as ex:
    ...     [r.text for r in ex.run_many(["print(1 + 1)", "1 / 0"])]
    """

    def __init__(self, cfg: "SandboxConfig", base_dir: Optional[str] = None, isolation: str = "auto"):
        """``isolation``: ``auto`` (the strongest this machine allows), ``user_namespace`` (the
        unprivileged path even as root) or ``none`` (no namespaces); the last two exist to test
        and debug the weaker configurations."""
        import tempfile

        if isolation not in ("auto", "user_namespace", "none"):
            raise ValueError(f"isolation={isolation!r}: expected 'auto', 'user_namespace' or 'none'")
        self.cfg = cfg
        self._is_root = os.geteuid() == 0 and isolation != "user_namespace"
        self._base = tempfile.mkdtemp(prefix="alp-sandbox-", dir=base_dir)
        self._remove_base = weakref.finalize(self, shutil.rmtree, self._base, True)  # also at exit
        os.chmod(self._base, 0o711)
        self._rootfs = os.path.join(self._base, "rootfs")
        os.mkdir(self._rootfs, 0o755)
        self._uids, self._uid_locks = _claim_uids(cfg.workers) if self._is_root else ([None] * cfg.workers, [])
        self._slots: SimpleQueue = SimpleQueue()  # worker slots: each has its own uid as root
        for slot in range(cfg.workers):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="sandbox")
        self._closed = False
        self.setup_notes: list[str] = []
        self._namespaces = isolation != "none"
        probe = self.run("pass")
        if probe.status == "sandbox_error" and self._namespaces and isolation == "auto":
            self.setup_notes.append(f"namespaces unavailable: {probe.text}")
            self._namespaces = False
            probe = self.run("pass")
        if probe.status != "ok":
            self.close()
            raise RuntimeError(f"the Python sandbox does not start on this machine: {probe.text}")
        self.protections: frozenset[str] = frozenset(probe.protections)
        if "mount_namespace" not in self.protections:
            msg = "; ".join([
                "the Python sandbox runs without Linux namespaces (active protections: "
                f"{', '.join(sorted(self.protections))})", *self.setup_notes])
            if cfg.require_isolation:
                self.close()
                raise RuntimeError(msg + " -- tir.sandbox.require_isolation is true")
            import warnings

            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ public API

    def run(self, code: str) -> ExecutionResult:
        """Execute one snippet (blocks; uses a free worker slot)."""
        slot = self._slots.get()
        try:
            return self._execute(code, slot)
        except Exception as err:  # the trainer must never see an executor failure as an exception
            return ExecutionResult(f"Error: the sandbox failed: {err}", "sandbox_error")
        finally:
            self._slots.put(slot)

    def run_many(self, codes: list[str]) -> list[ExecutionResult]:
        """Execute many snippets in parallel (``cfg.workers`` at a time); results in input order."""
        if self._closed:
            raise RuntimeError("SandboxExecutor is closed")
        return list(self._pool.map(self.run, codes))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._remove_base()
        for fd in self._uid_locks:
            os.close(fd)
        self._uid_locks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals

    def _spec(self, workdir: str, slot: int) -> dict:
        cfg = self.cfg
        uid = self._uids[slot]
        return {
            "namespaces": self._namespaces,
            "root": self._is_root,
            "uid": uid,
            "outer_uid": os.getuid(),
            "outer_gid": os.getgid(),
            "workdir": workdir,
            "rootfs": self._rootfs,
            "ro_binds": _ro_binds(),
            "cpu_s": cfg.cpu_time_s,
            "memory_mb": cfg.memory_mb,
            "file_mb": cfg.max_file_mb,
            "nproc": cfg.max_processes,
        }

    def _execute(self, code: str, slot: int) -> ExecutionResult:
        import tempfile

        cfg = self.cfg
        t0 = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="run-", dir=self._base)
        spec = self._spec(workdir, slot)
        if self._is_root:
            os.chown(workdir, spec["uid"], spec["uid"])
        os.chmod(workdir, 0o700)
        status_r, status_w = os.pipe()
        proc = None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-u", os.path.abspath(__file__), "--child", json.dumps(spec),
                 str(status_w)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=dict(_CHILD_ENV), cwd=workdir, start_new_session=True, close_fds=True,
                pass_fds=(status_w,),
            )
            os.close(status_w)
            status_w = -1
            try:
                proc.stdin.write(code.encode("utf-8", "surrogatepass"))
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            out, timed_out = self._collect(proc, t0 + cfg.wall_time_s)
            _kill_group(proc.pid)
            if self._is_root and not self._namespaces:
                _kill_uid(spec["uid"])  # no PID namespace: catch processes that left the group
            proc.wait()
            messages = _read_status(status_r)
        finally:
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            if proc is not None and proc.poll() is None:
                _kill_group(proc.pid)
                proc.wait()
            _force_rmtree(workdir)
        text, truncated = out.text()
        return self._result(text, truncated, timed_out, proc.returncode, messages, time.monotonic() - t0)

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[_OutputBuffer, bool]:
        """Read output until EOF, or the wall-clock deadline (then True: timed out)."""
        out = _OutputBuffer(self.cfg.max_output_bytes)
        fd = proc.stdout.fileno()
        exited_at = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                return out, True
            ready, _, _ = select.select([fd], [], [], min(deadline - now, 0.1))
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    return out, False
                out.add(data)
            elif proc.poll() is not None:
                # the main process is gone but something still holds the pipe: give it a moment
                exited_at = exited_at or now
                if now - exited_at > 0.5:
                    return out, False

    def _result(self, text, truncated, timed_out, returncode, messages, duration) -> ExecutionResult:
        cfg = self.cfg
        protections = tuple(messages.get("protections", ()))
        if "setup_error" in messages:
            return ExecutionResult(f"Error: sandbox setup failed: {messages['setup_error']}", "sandbox_error",
                                   duration_s=duration)
        exit_code = messages.get("exit", returncode)
        if timed_out:
            status, note = "timeout", f"Error: execution timed out after {_format_seconds(cfg.wall_time_s)}"
        elif not protections:
            status = "sandbox_error"
            note = f"Error: the sandbox did not start (exit code {returncode})"
        elif exit_code is not None and exit_code < 0:
            sig = -exit_code
            if sig in (signal.SIGXCPU, signal.SIGKILL):
                status = "cpu_limit" if sig == signal.SIGXCPU else "killed"
                note = (f"Error: CPU time limit exceeded ({_format_seconds(cfg.cpu_time_s)})"
                        if sig == signal.SIGXCPU else "Error: execution killed (CPU or memory limit)")
            elif sig == signal.SIGXFSZ:
                status, note = "error", f"Error: file size limit exceeded ({cfg.max_file_mb} MB)"
            else:
                status, note = "killed", f"Error: execution killed by signal {signal.Signals(sig).name}"
        elif exit_code:
            status, note = "error", ""
        else:
            status, note = "ok", ""
        if note:
            text = f"{text.rstrip()}\n{note}" if text.strip() else note
        return ExecutionResult(text, status, exit_code, truncated, duration, protections)


def _ro_binds() -> list[str]:
    """Host directories the sandbox sees read-only: the system and this Python installation."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"]
    for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))):
        paths.append(os.path.realpath(p))
    out: list[str] = []
    for p in paths:
        if p != "/" and os.path.lexists(p) and p not in out:
            out.append(p)
    return out


def _claim_uids(n: int) -> tuple[list[int], list[int]]:
    """``n`` sandbox uids no other executor on this machine holds (an flock per uid, released when
    the executor closes or its process dies), so process limits and kills never mix executions."""
    import fcntl
    import tempfile

    lock_dir = os.path.join(tempfile.gettempdir(), "alp-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    uids: list[int] = []
    fds: list[int] = []
    for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + 4096):
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uids.append(uid)
        fds.append(fd)
        if len(uids) == n:
            return uids, fds
    for fd in fds:
        os.close(fd)
    raise RuntimeError(f"no free sandbox uids in {SANDBOX_UID_BASE}-{SANDBOX_UID_BASE + 4095} for {n} workers")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (stragglers that left the process group with setsid)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    os.kill(int(name), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass


def _read_status(fd: int) -> dict:
    """JSON lines the child's setup code wrote to the status pipe (all writers have exited)."""
    os.set_blocking(fd, False)
    chunks = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not data:
            break
        chunks.append(data)
    merged: dict = {}
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            merged.update(json.loads(line))
        except ValueError:
            pass
    return merged


def _force_rmtree(path: str) -> None:
    """Remove an execution's directory, even where the code made it hard (``chmod 000``)."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
        return
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


# =========================================================================== child side
# Everything below runs in the sandbox process (this file executed with ``--child``). It uses the
# standard library only and is careful to finish confinement before the model's code runs.

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME = 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
_NET_EVENTS = {"socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
               "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "os.chflags", "os.mkfifo", "os.mknod", "os.setxattr",
                "os.removexattr", "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree"}


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


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


def _enter_namespaces(spec: dict) -> list[str]:
    libc = _libc()
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    active = ["mount_namespace", "net_namespace", "pid_namespace"]
    if not spec["root"]:
        flags |= _CLONE_NEWUSER
        active.append("user_namespace")
    _check(libc.unshare(flags), "unshare")
    if not spec["root"]:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {spec['outer_uid']} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {spec['outer_gid']} 1")
    return active


def _build_root(spec: dict) -> None:
    """In the new mount namespace: a read-only tmpfs root holding read-only binds of the system
    and Python directories, device nodes, a fresh /proc and the writable /sandbox; pivot into it."""
    libc = _libc()
    root = spec["rootfs"]
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    for path in spec["ro_binds"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
            continue
        os.makedirs(target, exist_ok=True)
        _mount(libc, path, target, None, _MS_BIND | _MS_REC)
        _mount(libc, None, target, None,
               _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _kept_flags(path))
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + dev):
            open(root + "/dev/" + dev, "w").close()
            _mount(libc, "/dev/" + dev, root + "/dev/" + dev, None, _MS_BIND)
    os.makedirs(root + "/proc")
    try:
        _mount(libc, "proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:
        pass  # e.g. a container masks parts of /proc; the sandbox then has an empty /proc
    os.makedirs(root + SANDBOX_DIR)
    _mount(libc, spec["workdir"], root + SANDBOX_DIR, None, _MS_BIND)
    _mount(libc, None, root + SANDBOX_DIR, None,
           _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | _kept_flags(spec["workdir"]))
    if not os.path.lexists(root + "/tmp"):
        os.symlink(SANDBOX_DIR, root + "/tmp")
    os.chdir(root)
    nr = _SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
    if nr is not None:
        _check(libc.syscall(nr, b".", b"."), "pivot_root")
        _check(libc.umount2(b".", _MNT_DETACH), "umount old root")
    else:
        os.chroot(".")
    os.chdir("/")
    _mount(libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(SANDBOX_DIR)


def _drop_privileges(spec: dict) -> list[str]:
    """Drop capabilities (and, as root, switch to the slot's uid); returns what is now active."""
    import ctypes

    libc = _libc()
    active = []
    is_root_here = os.geteuid() == 0
    if is_root_here:
        last_cap = 40
        try:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last_cap = int(f.read())
        except OSError:
            pass
        for cap in range(last_cap + 1):
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    uid = spec["uid"]
    if spec["root"] and uid is not None and (
        spec["namespaces"] or _readable_as(uid, [sys.base_prefix, sys.prefix, os.getcwd()])
    ):
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        active += ["uid_drop", "cap_drop"]
    elif is_root_here:  # root of a user namespace (or a root that kept its uid): clear every capability set
        nr = _SYSCALLS.get(os.uname().machine, {}).get("capset")
        if nr is not None:
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)
            data = (ctypes.c_uint32 * 6)()
            _check(libc.syscall(nr, header, data), "capset")
            active.append("cap_drop")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        active.append("no_new_privs")
    return active


def _readable_as(uid: int, paths: list[str]) -> bool:
    """Whether ``uid`` can use the interpreter and the working directory (checked as that uid)."""
    os.setegid(uid)
    os.seteuid(uid)
    try:
        return all(os.access(p, os.R_OK | os.X_OK, effective_ids=True) for p in paths)
    finally:
        os.seteuid(0)
        os.setegid(0)


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


def _set_limits(spec: dict, helpers: int) -> list[str]:
    """CPU, address space, file size, open files, core dumps and processes. ``helpers`` is the
    number of sandbox processes the kernel counts against the same process limit."""
    import math
    import resource

    cpu = max(1, math.ceil(spec["cpu_s"]))
    memory = spec["memory_mb"] << 20
    fsize = spec["file_mb"] << 20
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
              (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NOFILE, 256, 256)]
    active = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "rlimit_nofile"]
    if os.getuid() != 0 or spec["namespaces"] and not spec["root"]:
        if spec["namespaces"] or spec["uid"] is not None:
            nproc = spec["nproc"] + helpers
        else:  # shared with every process of this user: what exists now plus the budget
            nproc = _user_task_count() + spec["nproc"]
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
        if spec["outer_uid"] != 0 or spec["uid"] is not None:
            active.append("rlimit_nproc")  # the kernel does not enforce it for the real root
    for limit, soft, hard in limits:
        resource.setrlimit(limit, (soft, hard))
    return active


def _install_audit_hook(workdir: str) -> None:
    allowed = (os.path.realpath(workdir) + os.sep, "/dev/null")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath = os.path.realpath

    def inside(path) -> bool:
        if isinstance(path, int) or path is None:
            return True
        try:
            p = realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == allowed[1] or (p + os.sep).startswith(allowed[0])

    def hook(event, args):
        if event in _NET_EVENTS:
            raise PermissionError("network access is disabled in the sandbox")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(flags, int) and flags & write_flags) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and not inside(path):
                raise PermissionError(f"writing outside the sandbox directory is not allowed: {path}")
        elif event in _PATH_EVENTS:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"changing files outside the sandbox directory is not allowed: {arg}")

    sys.addaudithook(hook)


def _run_code(code: str) -> int:
    """Execute like a notebook cell; print a traceback without sandbox frames on error."""
    import ast
    import linecache
    import traceback

    lines = code.splitlines(keepends=True)
    linecache.cache["<code>"] = (len(code), None, lines, "<code>")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), scope)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code)
        return 1
    except BaseException as e:  # noqa: BLE001 - the code's own errors are its output
        report = traceback.TracebackException(type(e), e, e.__traceback__)
        frames = [f for f in report.stack if f.filename != __file__]
        report.stack = traceback.StackSummary.from_list(frames)
        sys.stdout.flush()
        print("".join(report.format()), end="", file=sys.stdout)
        return 1
    finally:
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass


def _report(status_fd: int, **message) -> None:
    os.write(status_fd, (json.dumps(message) + "\n").encode())


def _child_main(spec: dict, status_fd: int) -> None:
    import ast, ctypes, linecache, math, resource, traceback  # noqa: E401,F401 - load before confinement

    code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    protections = ["empty_env", "private_cwd", "process_group_kill"]
    helpers = 0
    try:
        if spec["namespaces"]:
            protections += _enter_namespaces(spec)
            init = os.fork()
            if init:  # outside the PID namespace: wait, the namespace's init reports the status
                os.waitpid(init, 0)
                os._exit(0)
            _build_root(spec)
            worker = os.fork()
            if worker:  # pid 1 of the namespace: reap everything, report the code's exit status
                while True:
                    pid, status = os.wait()
                    if pid == worker:
                        _report(status_fd, exit=os.waitstatus_to_exitcode(status))
                        os._exit(0)
            helpers = 0 if spec["root"] else 2  # a user namespace counts its setup processes too
        protections += _drop_privileges(spec)
        protections += _set_limits(spec, helpers)
        _install_audit_hook(os.getcwd())
        protections.append("audit_hook")
    except Exception as err:  # noqa: BLE001 - reported to the parent, which falls back or errors
        _report(status_fd, setup_error=f"{type(err).__name__}: {err}")
        os._exit(_EXIT_SETUP_FAILED)
    os.environ["HOME"] = os.environ["TMPDIR"] = os.getcwd()
    _report(status_fd, protections=protections)
    os.close(status_fd)
    sys.exit(_run_code(code))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    _child_main(json.loads(sys.argv[2]), int(sys.argv[3]))
