"""The trainer's side of the sandbox: starts one confined interpreter per execution
(:mod:`.confine`), feeds it the code, collects its output under the time and output limits,
stops whatever it left and turns the outcome into an :class:`ExecutionResult`.

Fails closed: an executor that cannot fully isolate executions on this machine raises
:class:`SandboxUnavailableError` naming what is missing, unless ``tir.sandbox.allow_unsafe`` asks
for the unsafe mode (see ``docs/sandbox.md`` for what each mode guarantees).
"""

from __future__ import annotations

import ast
import fcntl
import logging
import marshal
import os
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Optional

from megatron_alp.config import InputError
from megatron_alp.tir.sandbox.cgroup import ExecutionCgroups, ExecutionGroup
from megatron_alp.tir.sandbox.cleanup import remove_tree
from megatron_alp.tir.sandbox.syscall_filter import compile_filter

if TYPE_CHECKING:
    from megatron_alp.config import SandboxConfig

LOG = logging.getLogger(__name__)
SANDBOX_UID_BASE = 61000
SANDBOX_UID_COUNT = 4096
# Output beyond this many times ``max_output_bytes`` stops the execution: reading more costs the
# trainer CPU time and shows the model nothing it would not see anyway.
OUTPUT_KILL_FACTOR = 64
# The start-up probe's wall-clock limit: a loaded machine must not look like one without isolation.
PROBE_WALL_TIME_S = 60.0
CLEANUP_TIMEOUT_S = 10.0
BUSY_GROUP_WAIT_S = 0.2
STOP_TIMEOUT_S = 5.0
# Every isolated execution has all of these; an executor that cannot provide them does not start.
ISOLATED_PROTECTIONS = frozenset({
    "mount_namespace", "pid_namespace", "net_namespace", "ipc_namespace", "uts_namespace", "cgroup_namespace",
    "private_proc", "private_tmpfs", "disk_quota", "cap_drop", "no_new_privs", "seccomp", "rlimit_cpu", "rlimit_as",
    "rlimit_fsize", "rlimit_nofile", "rlimit_nproc", "empty_env", "process_group_kill", "own_session",
})
# Where isolated executions see the virtual environment (its host path names the project).
VENV_DIR = "/venv"
# Files of the virtual environment that name host paths: pyvenv.cfg, editable installs' path hooks
# and finders, and each distribution's direct_url.json.
_VENV_FILE_PATTERNS = ("pyvenv.cfg", "lib/python*/site-packages/*.pth", "lib/python*/site-packages/__editable__*",
                       "lib/python*/site-packages/*.egg-link", "lib/python*/site-packages/*.dist-info/direct_url.json")

# Fixed environment of the executed code: nothing of the trainer's (HOME and TMPDIR are set inside).
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# The interpreter reads the confinement program, compiled here once, from stdin: no host path shows
# in its command line (``/proc/1/cmdline`` inside the sandbox) and no execution compiles it again.
# The command line ends with a marker that tells what the process is (``ps``).
_PROGRAM = marshal.dumps(compile(Path(__file__).with_name("confine.py").read_bytes(), "<sandbox>", "exec"))
COMMAND_MARKER = "#megatron-alp-sandbox"
# The program of the interpreter that runs the code (:mod:`.cell`), compiled here once; it travels
# ahead of the code in the descriptor that interpreter reads.
_CELL = marshal.dumps(compile(Path(__file__).with_name("cell.py").read_bytes(), "<cell>", "exec"))
_BOOTSTRAP = f"import marshal,sys;exec(marshal.loads(sys.stdin.buffer.read({len(_PROGRAM)}))){COMMAND_MARKER}"


class SandboxUnavailableError(InputError):
    """This machine cannot isolate executions and the unsafe mode was not allowed. An input error for
    the command line (one message, exit status 2): the fix is the machine's set-up or the named key."""


class ExecutionResult:
    """What one execution produced. ``text`` is what the model sees; ``status`` is one of ``ok``,
    ``error`` (exception or non-zero exit), ``timeout`` (wall clock), ``cpu_limit``,
    ``output_limit`` (stopped for printing too much), ``killed`` (a signal) or ``sandbox_error``
    (the sandbox itself failed)."""

    __slots__ = ("text", "status", "exit_code", "truncated", "duration_s", "protections")

    def __init__(self, text: str, status: str, exit_code: Optional[int] = None, truncated: bool = False,
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
            self.tail += data[-self.limit:]
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


def signal_name(sig: int) -> str:
    """``SIGSEGV``, ``SIGRTMIN+3``: a name for every signal number (Python names only some; the
    real-time signals below libc's SIGRTMIN are the ones libc keeps for itself)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        if sig < signal.SIGRTMIN:
            return f"SIGRTMIN-{signal.SIGRTMIN - sig}"
        if sig - signal.SIGRTMIN <= (signal.SIGRTMAX - signal.SIGRTMIN) // 2:
            return f"SIGRTMIN+{sig - signal.SIGRTMIN}"
        return f"SIGRTMAX-{signal.SIGRTMAX - sig}"


def _seconds(s: float) -> str:
    return f"{s:g} s"


class SandboxExecutor:
    """Runs Python code in sandboxed processes, at most ``cfg.workers`` at a time.

    >>> with SandboxExecutor(cfg) as ex:
    ...     [r.text for r in ex.run_many(["print(1 + 1)", "1 / 0"])]
    """

    def __init__(self, cfg: "SandboxConfig", base_dir: Optional[str] = None, isolation: str = "auto",
                 cgroup: str = "auto"):
        """``isolation``: ``auto`` (as root: namespaces built with root's privileges, else an
        unprivileged user namespace), ``user_namespace`` (the unprivileged path even as root) or
        ``none`` (the unsafe mode; needs ``cfg.allow_unsafe``). The last two exist to test and
        debug those paths. ``cgroup``: ``auto`` (a memory cgroup per execution where this machine
        lets this process make one) or ``off`` (the weaker memory bound without; to test it and
        to measure the cgroup's cost). ``base_dir``: where the unsafe mode makes its working
        directories (the system's temporary directory by default); isolated executions write
        nothing to the host."""
        if isolation not in ("auto", "user_namespace", "none"):
            raise ValueError(f"isolation={isolation!r}: expected 'auto', 'user_namespace' or 'none'")
        if cgroup not in ("auto", "off"):
            raise ValueError(f"cgroup={cgroup!r}: expected 'auto' or 'off'")
        if isolation == "none" and not cfg.allow_unsafe:
            raise ValueError("isolation='none' runs code without isolation: it needs tir.sandbox.allow_unsafe: true")
        self.cfg = cfg
        self._closed = False
        self._is_root = os.geteuid() == 0
        self._uids, uid_locks = _claim_uids(cfg.workers) if self._is_root else ([None] * cfg.workers, [])
        self._finalizers = [weakref.finalize(self, _close_fds, uid_locks)]  # also run at interpreter exit
        self._slots: SimpleQueue = SimpleQueue()  # worker slots: each has its own uid as root
        for slot in range(cfg.workers):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="sandbox")
        self._base_dir = base_dir
        self._base: Optional[str] = None
        # CPU cores the executions run on (None: those this process had when the executor started).
        # Asynchronous training on the CPU sets the engines' cores: code runs on the rollout side.
        self.cores: Optional[tuple[int, ...]] = None
        self._start_cores = tuple(sorted(os.sched_getaffinity(0)))
        self.setup_notes: list[str] = []
        self.protections: frozenset[str] = frozenset()
        self._cgroups: Optional[ExecutionCgroups] = None
        self._groups: list = []  # each worker slot's cgroups (ExecutionGroup), with a memory cgroup
        self.memory_bound = ""
        self.startup_line = ""
        try:
            self._start(isolation, cgroup)
        except BaseException:
            self.close()
            raise
        LOG.info(self.startup_line)

    def _start(self, isolation: str, cgroup: str) -> None:
        """Choose the strongest mode that works here, or raise :class:`SandboxUnavailableError`."""
        cfg = self.cfg
        if cgroup == "auto":
            self._cgroups, where = ExecutionCgroups.find()
        else:
            where = "switched off"
        if self._cgroups is not None:
            self._finalizers.append(weakref.finalize(self, self._cgroups.close))
            self._groups = [self._cgroups.create((cfg.memory_mb + cfg.disk_mb) << 20, cfg.max_processes + 2)
                            for _ in range(cfg.workers)]
            self.memory_bound = (f"memory cgroup per execution ({where}): {cfg.memory_mb + cfg.disk_mb} MiB for all "
                                 f"its memory (processes, System V IPC, sockets, memfd, tmpfs), {self._cgroups.swap()}")
        else:
            self.memory_bound = (f"no memory cgroup ({where}): {cfg.memory_mb} MiB of address space per process "
                                 f"(x {cfg.max_processes}) + {cfg.disk_mb} MiB tmpfs; Unix sockets, System V "
                                 "semaphores and memfd_create refused (kernel memory no limit would count)")
        try:
            self._seccomp: Optional[str] = compile_filter(self._cgroups is not None).hex()
        except (RuntimeError, OSError) as err:
            self._seccomp = None
            self.setup_notes.append(f"seccomp: {err}")
        if isolation != "none":
            paths = ["root", "user_namespace"] if isolation == "auto" and self._is_root else ["user_namespace"]
            for path in paths if self._seccomp is not None else ():
                self._mode = path
                problem = self._probe(ISOLATED_PROTECTIONS)
                if problem is None:
                    if self._cgroups is None and not cfg.allow_no_memory_cgroup:
                        raise SandboxUnavailableError(
                            f"the TIR sandbox has no memory cgroup for its executions here ({where}), so the kernel "
                            "memory they pin (socket buffers, IPC objects) would be bounded only by refusing those "
                            "calls. Delegate the memory controller to the trainer's cgroup (cgroup v2) or run where "
                            "a cgroup v1 memory hierarchy is writable (docs/sandbox.md), or set "
                            "tir.sandbox.allow_no_memory_cgroup: true to accept that weaker bound")
                    return
                self.setup_notes.append(f"{path}: {problem}")
            if not self.cfg.allow_unsafe:
                raise SandboxUnavailableError(
                    f"the TIR sandbox cannot isolate executions on this machine ({'; '.join(self.setup_notes)}). "
                    "Run as root, or where unprivileged user namespaces and seccomp are available (see "
                    "docs/sandbox.md), or set tir.sandbox.allow_unsafe: true to run model-written code WITHOUT "
                    "isolation (local debugging only)")
        if self._seccomp is None:  # every entry point, isolation="none" included
            raise SandboxUnavailableError(
                f"the TIR sandbox refuses even its unsafe mode without a system-call filter "
                f"({'; '.join(self.setup_notes)}): install the libseccomp2 system package")
        if isolation != "none":
            warnings.warn(f"the TIR sandbox runs in its UNSAFE mode (tir.sandbox.allow_unsafe): "
                          f"{'; '.join(self.setup_notes)}", RuntimeWarning, stacklevel=3)
        self._mode = "unsafe"
        self._base = tempfile.mkdtemp(prefix="alp-sandbox-", dir=self._base_dir)
        self._finalizers.append(weakref.finalize(self, _remove_dir, self._base))
        os.chmod(self._base, 0o711)  # the slots' uids reach their own working directories in it
        problem = self._probe(frozenset({"empty_env", "private_cwd", "no_new_privs", "rlimit_cpu", "rlimit_as"}))
        if problem is not None:
            hint = (f" (as root it runs code as uid {self._uids[0]} and up, which must be able to read the "
                    "Python installation)") if self._is_root else ""
            raise SandboxUnavailableError(f"the TIR sandbox does not start here even in its unsafe mode{hint}: "
                                          f"{problem}")

    def _describe(self) -> str:
        """The start-up line: mode, protections and which memory bound holds."""
        mode = {"root": "full isolation (namespaces built as root)",
                "user_namespace": "full isolation (unprivileged user namespace)",
                "unsafe": "UNSAFE mode (no namespaces)"}[self._mode]
        return (f"TIR sandbox: {mode}, {self.cfg.workers} workers; memory: {self.memory_bound}; "
                f"protections: {', '.join(sorted(self.protections))}")

    def _probe(self, required: frozenset) -> Optional[str]:
        """Run ``pass``; None if it worked with every ``required`` protection, else why not."""
        probe = self.run("pass", wall_time_s=max(self.cfg.wall_time_s, PROBE_WALL_TIME_S))
        if probe.status != "ok":
            return probe.text
        missing = required - set(probe.protections)
        if missing:
            return f"missing protections: {', '.join(sorted(missing))}"
        self.protections = frozenset(probe.protections)
        self.startup_line = self._describe()
        return None

    # ------------------------------------------------------------------ public API

    def run(self, code: str, wall_time_s: Optional[float] = None) -> ExecutionResult:
        """Execute one snippet (blocks; uses a free worker slot); ``wall_time_s`` overrides the
        configured wall-clock limit."""
        if self._closed:
            return ExecutionResult("Error: the sandbox is closed", "sandbox_error")
        slot = self._slots.get()
        try:
            return self._execute(code, slot, wall_time_s or self.cfg.wall_time_s)
        except Exception as err:  # the trainer must never see an executor failure as an exception
            return ExecutionResult(f"Error: the sandbox failed: {type(err).__name__}: {err}", "sandbox_error")
        finally:
            self._slots.put(slot)

    def run_many(self, codes: list[str]) -> list[ExecutionResult]:
        """Execute many snippets in parallel (``cfg.workers`` at a time); results in input order."""
        if self._closed:
            raise RuntimeError("SandboxExecutor is closed")
        return list(self._pool.map(self.run, codes))

    def close(self) -> None:
        """Wait for running executions, remove the executor's directory, release its uids. Never
        raises: it runs in the trainer's shutdown path."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"sandbox shutdown: {err}", RuntimeWarning, stacklevel=2)
        for finalizer in self._finalizers:
            finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals

    def _execute(self, code: str, slot: int, wall_time_s: float) -> ExecutionResult:
        cfg = self.cfg
        t0 = time.monotonic()
        isolated = self._mode != "unsafe"
        uid = self._uids[slot]
        workdir = None
        if not isolated:
            workdir = tempfile.mkdtemp(prefix="run-", dir=self._base)
            if uid is not None:
                os.chown(workdir, uid, uid)
        status_r, status_w = os.pipe()
        spec = {
            "isolated": isolated,
            "user_namespace": self._mode == "user_namespace",
            "uid": uid,
            "parent": os.getpid(),
            "status_fd": status_w,
            "workdir": workdir,
            "ro_binds": _ro_binds(),
            "venv": [_VENV, VENV_DIR] if _VENV else None,
            "venv_masks": _VENV_MASKS,
            "venv_links": _VENV_LINKS,
            "executable": VENV_DIR + _VENV_EXECUTABLE if isolated and _VENV else sys.executable,
            "cell": _CELL.hex(),
            "marker": COMMAND_MARKER,
            "disk_mb": cfg.disk_mb,
            "cpu_s": cfg.cpu_time_s,
            "memory_mb": cfg.memory_mb,
            "file_mb": cfg.max_file_mb,
            "nproc": cfg.max_processes,
            "seccomp": self._seccomp,
            # what the start-up probe had (none during the probe): an execution short of any does not run
            "required": sorted(self.protections - {"memory_cgroup"}),
        }
        # the root path starts as root; otherwise, as root, the process starts as the slot's uid
        as_uid = {} if uid is None or self._mode == "root" else {"user": uid, "group": uid, "extra_groups": []}
        # this pool thread's affinity, which the execution's process inherits
        os.sched_setaffinity(0, self.cores if self.cores is not None else self._start_cores)
        proc = None
        group = self._groups[slot] if self._groups else None
        oom_kills = group.oom_kills() if group is not None else 0
        try:
            proc = subprocess.Popen(
                [_INTERPRETER, "-I", "-S", "-u", "-c", _BOOTSTRAP],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(_CHILD_ENV),
                cwd=workdir or "/", start_new_session=True, close_fds=True, pass_fds=(status_w,), **as_uid,
            )
            os.close(status_w)
            status_w = -1
            if group is not None:  # before it reads the code: all it does from then on is charged there
                group.attach(proc.pid)
            spec_bytes = marshal.dumps(spec)
            payload = (_PROGRAM + len(spec_bytes).to_bytes(4, "little") + spec_bytes
                       + code.encode("utf-8", "surrogatepass"))
            out, status, ending = self._collect(proc, payload, status_r, t0 + wall_time_s)
            messages = _parse_status(status)
            self._stop(proc, messages.get("init"), isolated, uid)
            if group is not None:
                messages["oom"] = group.oom_kills() > oom_kills
                messages.setdefault("protections", []).append("memory_cgroup")
        finally:
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            if proc is not None:
                if proc.poll() is None:
                    _kill_group(proc.pid)
                    proc.wait()
                proc.stdin.close()
                proc.stdout.close()
            if group is not None and _still_busy(group):  # the slot's next execution gets a group of its own
                self._groups[slot] = self._cgroups.create((cfg.memory_mb + cfg.disk_mb) << 20, cfg.max_processes + 2)
            if workdir is not None and not remove_tree(workdir, CLEANUP_TIMEOUT_S):
                warnings.warn(f"sandbox: could not remove {workdir} within {CLEANUP_TIMEOUT_S:g} s",
                              RuntimeWarning, stacklevel=2)
        text, truncated = out.text()
        return _execution_result(cfg, text, truncated, ending, proc.returncode, messages, isolated, wall_time_s,
                                time.monotonic() - t0)

    def _collect(self, proc: subprocess.Popen, payload: bytes, status_fd: int, deadline: float):
        """Write ``payload`` to the process's stdin and read its output and status until the
        execution ends, all under the deadline; ``ending`` is ``done``, ``timeout`` or
        ``output_limit``."""
        out = _OutputBuffer(self.cfg.max_output_bytes)
        kill_at = self.cfg.max_output_bytes * OUTPUT_KILL_FACTOR
        status = bytearray()
        stdin_fd = proc.stdin.fileno()
        pending = memoryview(payload)
        os.set_blocking(stdin_fd, False)
        exited_at = None
        # a selector, not select(): the trainer may hold descriptors numbered above FD_SETSIZE (1024)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
            sel.register(status_fd, selectors.EVENT_READ)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
            while len(sel.get_map()) > (1 if pending else 0):
                now = time.monotonic()
                if now >= deadline:
                    return out, status, "timeout"
                events = sel.select(min(deadline - now, 0.1))
                for key, mask in events:
                    fd = key.fd
                    if mask & selectors.EVENT_WRITE:
                        try:
                            pending = pending[os.write(fd, pending[:1 << 16]):]
                        except BrokenPipeError:  # it exited without reading all: its status says why
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    data = os.read(fd, 1 << 20)
                    if not data:
                        sel.unregister(fd)
                    elif fd == status_fd:
                        status += data
                    else:
                        out.add(data)
                        if out.total > kill_at:
                            return out, status, "output_limit"
                if not events and proc.poll() is not None:
                    # the started process is gone but something it left holds a pipe (unsafe mode)
                    exited_at = exited_at or now
                    if now - exited_at > 0.5:
                        break
        return out, status, "done"

    def _stop(self, proc: subprocess.Popen, init: Optional[int], isolated: bool, uid: Optional[int]) -> None:
        """Kill whatever the execution still runs and wait for it to be gone."""
        if init is not None and proc.poll() is None:
            # the outer process has not reaped init, so the pid is still init's; it exits once init
            # and with it the whole PID namespace are gone
            _kill(init)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)
        proc.wait()
        if not isolated:  # no PID namespace: the process group, and as root every process of the slot's uid
            _sweep(proc.pid, uid, STOP_TIMEOUT_S)


def _execution_result(cfg: "SandboxConfig", text: str, truncated: bool, ending: str, returncode: Optional[int],
                     messages: dict, isolated: bool, wall_time_s: float, duration: float) -> ExecutionResult:
    """What an execution that ended (``ending``: ``done``, ``timeout`` or ``output_limit``) produced, from
    its output and the status lines of its confinement program (``messages``)."""
    protections = tuple(messages.get("protections", ()))
    if "setup_error" in messages:
        return ExecutionResult(f"Error: sandbox setup failed: {messages['setup_error']}", "sandbox_error",
                               duration_s=duration)
    exit_code = messages.get("exit") if isolated else returncode
    if ending == "timeout":
        status, note = "timeout", f"Error: execution timed out after {_seconds(wall_time_s)}"
    elif ending == "output_limit":
        status = "output_limit"
        note = ("Error: output limit exceeded: execution stopped after "
                f"{OUTPUT_KILL_FACTOR * cfg.max_output_bytes} bytes")
    elif not protections:
        status, note = "sandbox_error", f"Error: the sandbox did not start (exit code {returncode})"
    elif exit_code is None:
        status, note = "killed", "Error: execution killed (its sandbox was stopped from outside)"
    elif exit_code < 0:
        sig = -exit_code
        status, note = "killed", f"Error: execution killed by signal {signal_name(sig)}"
        if sig == signal.SIGXCPU:
            status, note = "cpu_limit", f"Error: CPU time limit exceeded ({_seconds(cfg.cpu_time_s)})"
        elif sig == signal.SIGKILL and messages.get("oom"):
            note = f"Error: memory limit exceeded ({cfg.memory_mb + cfg.disk_mb} MiB for the whole execution)"
        elif sig == signal.SIGKILL:
            note = "Error: execution killed (SIGKILL: CPU or memory limit)"
        elif sig == signal.SIGXFSZ:
            status, note = "error", f"Error: file size limit exceeded ({cfg.max_file_mb} MB)"
        elif sig == signal.SIGSYS:
            note = "Error: execution killed by signal SIGSYS (a forbidden system call)"
    elif exit_code:
        status, note = "error", ""
    else:
        status, note = "ok", ""
    if note:
        text = f"{text.rstrip()}\n{note}" if text.strip() else note
    return ExecutionResult(text, status, exit_code, truncated, duration, protections)


def _venv() -> tuple[Optional[str], str]:
    """This interpreter's virtual environment (its real path) and the executable's path in it."""
    if sys.prefix == sys.base_prefix:
        return None, ""
    return os.path.realpath(sys.prefix), "/" + os.path.relpath(sys.executable, sys.prefix)


def _venv_masks(venv: Optional[str]) -> dict[str, str]:
    """What isolated executions see instead of the virtual environment's files that name the
    directory holding it (relative path -> content): those lines dropped; code (an editable
    install's finder, and the ``.pth`` hook that imports it) emptied, since it would not run."""
    if venv is None:
        return {}
    hidden = os.path.dirname(venv) if os.path.dirname(venv) != "/" else venv
    texts = {}
    for pattern in _VENV_FILE_PATTERNS:
        for path in sorted(Path(venv).glob(pattern)):
            try:
                texts[path] = path.read_text(errors="replace")
            except OSError:
                pass
    masks = {}
    for path, text in texts.items():
        if hidden in text and path.suffix not in (".py", ".pth"):
            masks[str(path.relative_to(venv))] = "".join(
                line for line in text.splitlines(keepends=True) if hidden not in line)
        elif hidden in text:
            masks[str(path.relative_to(venv))] = ""
    emptied = {Path(p).stem for p, text in masks.items() if p.endswith(".py")}
    for path, text in texts.items():
        if path.suffix == ".pth" and any(stem in text for stem in emptied):
            masks[str(path.relative_to(venv))] = ""
    return masks


def _venv_links(venv: Optional[str]) -> dict[str, str]:
    """The virtual environment's links to the interpreter (``python``, ``python3``...: name -> link),
    all that isolated executions see of its ``bin``."""
    if venv is None:
        return {}
    links = {}
    for entry in os.scandir(os.path.join(venv, "bin")):
        if entry.is_symlink() and os.path.realpath(entry.path) == _INTERPRETER:
            links[entry.name] = os.readlink(entry.path)
    return links


def _ro_binds() -> list[str]:
    """Host directories the sandbox sees read-only at their own paths: the system and the Python
    installation (a virtual environment is seen at ``VENV_DIR``)."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"]
    for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(_INTERPRETER)):
        paths.append(os.path.realpath(p))
    out: list[str] = []
    for p in paths:
        if p != "/" and os.path.lexists(p) and p not in out:
            out.append(p)
    return out


def _claim_uids(n: int) -> tuple[list[int], list[int]]:
    """``n`` sandbox uids no other executor on this machine holds (an flock per uid, released when
    the executor closes or its process dies), so process limits and kills never mix executions."""
    lock_dir = os.path.join(tempfile.gettempdir(), "alp-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    st = os.lstat(lock_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxUnavailableError(f"{lock_dir} must be a directory of uid {os.geteuid()} that no one else "
                                      "can write to (another user made it?)")
    uids: list[int] = []
    fds: list[int] = []
    for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_COUNT):
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
    raise SandboxUnavailableError(f"no free sandbox uids in {SANDBOX_UID_BASE}-"
                                  f"{SANDBOX_UID_BASE + SANDBOX_UID_COUNT - 1} for {n} workers")


def _still_busy(group: ExecutionGroup) -> bool:
    """Whether tasks of an ended execution still count in its slot's group after a moment."""
    deadline = time.monotonic() + BUSY_GROUP_WAIT_S
    while group.busy():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)
    return False


def _remove_dir(path: str) -> None:
    """The unsafe mode's directory; warns, never raises."""
    try:
        if not remove_tree(path, CLEANUP_TIMEOUT_S):
            warnings.warn(f"sandbox: could not remove {path}", RuntimeWarning, stacklevel=2)
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"sandbox: could not remove {path}: {err}", RuntimeWarning, stacklevel=2)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _parse_status(data: bytes) -> dict:
    merged: dict = {}
    for line in bytes(data).decode("utf-8", "replace").splitlines():
        try:
            merged.update(ast.literal_eval(line))
        except (ValueError, SyntaxError, TypeError):
            pass
    return merged


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep(pgrp: int, uid: Optional[int], timeout_s: float) -> None:
    """Kill the live processes of process group ``pgrp`` and of ``uid`` (unsafe mode as root: the
    slot's uid runs nothing else) until there are none, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                owner = os.stat(f"/proc/{name}").st_uid
            except OSError:
                continue
            if fields[0] not in "ZX" and (int(fields[2]) == pgrp or owner == uid):
                found = True
                _kill(int(name))
        if not found:
            return
        time.sleep(0.01)


# The interpreter itself, not a virtual environment's link to it: the command line (and
# ``sys.orig_argv``) of the executed code names no path inside the project.
_INTERPRETER = os.path.realpath(sys.executable)
_VENV, _VENV_EXECUTABLE = _venv()
_VENV_MASKS = _venv_masks(_VENV)
_VENV_LINKS = _venv_links(_VENV)
