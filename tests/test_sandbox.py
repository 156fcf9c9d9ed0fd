"""The TIR Python sandbox: every limit and isolation it reports active is checked by code that
tries to break it; the trainer's files, environment and network stay out of reach."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest

from megatron_alp.config import SandboxConfig
from megatron_alp.tir.sandbox import SandboxExecutor

ROOT = Path(__file__).resolve().parents[1]
BASE = {"empty_env", "private_cwd", "process_group_kill", "rlimit_cpu", "rlimit_as", "rlimit_fsize", "audit_hook"}


def _cfg(**kw) -> SandboxConfig:
    # wall time well above CPU time: on a loaded 2-core machine a busy loop may get a third of a core
    return SandboxConfig(**{"cpu_time_s": 1.0, "wall_time_s": 8.0, "memory_mb": 512, "max_output_bytes": 2048,
                            "max_processes": 1, "workers": 2, **kw})


@pytest.fixture(scope="module")
def ex():
    with SandboxExecutor(_cfg()) as executor:
        yield executor


@pytest.fixture
def trainer_dir(tmp_path):
    """A stand-in for the trainer's run directory (checkpoints, config) that code will attack."""
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "config.yaml").write_text("model: secret\n")
    (d / "checkpoints" / "model.pt").write_bytes(os.urandom(4096))
    return d


def snapshot(*dirs: Path) -> dict:
    out = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns,
                           hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
        out[str(d)] = d.stat().st_mtime_ns
    return out


def sandbox_processes() -> list[int]:
    """Host processes still running this sandbox's code (forked children keep its command line)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if b"tir/sandbox.py" in cmd and b"--child" in cmd:
                found.append(int(name))
    return found


def test_reports_its_protections(ex):
    assert BASE <= ex.protections, ex.protections
    if "mount_namespace" in ex.protections:
        assert {"pid_namespace", "net_namespace", "cap_drop", "no_new_privs"} <= ex.protections
    if os.geteuid() == 0 and "mount_namespace" in ex.protections:
        assert "uid_drop" in ex.protections and "rlimit_nproc" in ex.protections


def test_runs_code_like_a_notebook_cell(ex):
    ok, err, syntax, exit3 = ex.run_many([
        "x = 6 * 7\nprint('x is', x)\nx + 1",
        "def f(n):\n    return 1 / n\nf(0)",
        "print(",
        "import sys\nprint('bye')\nsys.exit(3)",
    ])
    assert ok.status == "ok" and ok.text == "x is 42\n43\n" and ok.exit_code == 0
    assert err.status == "error" and "ZeroDivisionError: division by zero" in err.text
    assert 'File "<code>", line 2, in f' in err.text and "sandbox.py" not in err.text
    assert syntax.status == "error" and "SyntaxError" in syntax.text
    assert exit3.status == "error" and exit3.exit_code == 3 and "bye" in exit3.text


def test_cpu_limit_kills_busy_loops(ex):
    r = ex.run("while True:\n    pass")
    assert r.status == "cpu_limit" and "Error: CPU time limit exceeded (1 s)" in r.text
    assert r.duration_s < 8.0


def test_wall_clock_limit_kills_sleepers():
    with SandboxExecutor(_cfg(wall_time_s=1.5, workers=1)) as fast:
        t0 = time.monotonic()
        r = fast.run("import time\nprint('start', flush=True)\ntime.sleep(60)")
    assert r.status == "timeout" and r.text.startswith("start\n")
    assert r.text.endswith("Error: execution timed out after 1.5 s")
    assert time.monotonic() - t0 < 5.0


def test_memory_limit_stops_unbounded_allocation():
    with SandboxExecutor(_cfg(cpu_time_s=8.0, memory_mb=256)) as small:  # CPU ample: the memory limit acts
        loop, huge = small.run_many(["blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))",
                                     "x = bytearray(2**40)"])
    for r in (loop, huge):
        assert r.status in ("error", "killed"), r
        assert "MemoryError" in r.text or "memory limit" in r.text, r


def test_output_is_truncated_with_a_marker(ex):
    r = ex.run("print('HEAD')\nprint('x' * 5_000_000)\nprint('TAIL')")
    assert r.status == "ok" and r.truncated
    assert r.text.startswith("HEAD\n") and r.text.rstrip().endswith("TAIL")
    assert "[output truncated:" in r.text and "bytes omitted]" in r.text
    assert len(r.text.encode()) < 2048 + 100


def test_fork_bomb_is_refused(ex):
    if "rlimit_nproc" not in ex.protections:
        pytest.skip("process limit not enforceable here (real root without namespaces)")
    r = ex.run("import os\nfor _ in range(10_000):\n    os.fork()")
    assert r.status == "error" and ("BlockingIOError" in r.text or "Resource temporarily unavailable" in r.text)
    assert r.duration_s < 2.0
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_escaped_children_are_killed_with_the_execution():
    with SandboxExecutor(_cfg(max_processes=4, workers=1)) as ex4:
        if not {"pid_namespace", "uid_drop"} & ex4.protections:
            pytest.skip("without a PID namespace or a uid of its own, setsid() escapes the process group")
        r = ex4.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
        assert r.status == "ok" and "parent done" in r.text
        time.sleep(0.3)
        assert sandbox_processes() == []


def test_environment_is_not_inherited(ex, monkeypatch):
    monkeypatch.setenv("ALP_TRAINER_SECRET", "hunter2")
    r = ex.run(f"import os\nprint(sorted(os.environ))\ntry:\n"
               f"    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
               f"except OSError as e:\n    print('refused', type(e).__name__)")
    assert "hunter2" not in r.text and "ALP_TRAINER_SECRET" not in r.text
    names = eval(r.text.splitlines()[0])
    assert set(names) <= {"PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                          "HOME", "TMPDIR"}
    if {"pid_namespace", "uid_drop"} & ex.protections:
        assert "refused" in r.text


def test_network_is_refused(ex):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(server.accept())
            except socket.timeout:
                pass

    thread = threading.Thread(target=accept)
    thread.start()
    via_socket = ex.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    raw = ex.run(  # libc directly: bypasses the audit hook, so only the network namespace stops it
        "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
        f"addr = struct.pack('!HHI8x', 2, {port}, 0x7F000001)\naddr = struct.pack('=H', 2) + addr[2:]\n"
        "rc = libc.connect(fd, addr, len(addr))\nprint('rc', rc, 'errno', ctypes.get_errno())")
    time.sleep(0.3)  # a connection that got through would be accepted by now
    done.set()
    thread.join()
    server.close()
    assert via_socket.status == "error"
    assert "PermissionError: network access is disabled in the sandbox" in via_socket.text
    if "net_namespace" in ex.protections:
        assert raw.status == "ok" and "rc -1" in raw.text, raw.text
        assert accepted == []
    else:
        assert len(accepted) <= 1


def test_writes_outside_the_sandbox_change_nothing(ex, trainer_dir):
    repo_files = [ROOT / "pyproject.toml", ROOT / "megatron_alp" / "config.py"]
    before = snapshot(trainer_dir)
    repo_before = {p: p.stat().st_mtime_ns for p in repo_files}
    ckpt, cfg_file = trainer_dir / "checkpoints" / "model.pt", trainer_dir / "config.yaml"
    attempts = [
        f"open({str(ckpt)!r}, 'wb').write(b'pwned')",
        f"import os\nos.remove({str(cfg_file)!r})",
        f"import os\nos.rename({str(ckpt)!r}, {str(trainer_dir / 'stolen')!r})",
        f"open({str(trainer_dir / 'new.txt')!r}, 'w').write('x')",
        f"import shutil\nshutil.rmtree({str(trainer_dir)!r})",
        f"open({str(repo_files[0])!r}, 'a').write('# pwned')",
        "import os\nos.chdir('..')\nopen('escape.txt', 'w').write('x')",
        "import os\nos.symlink('/', 'root')\nopen('root/escape.txt', 'w').write('x')",
    ]
    results = ex.run_many(attempts)
    for code, r in zip(attempts, results):
        assert r.status == "error", (code, r.text)
        assert any(s in r.text for s in ("PermissionError", "not allowed", "Read-only", "No such file")), r.text
    if {"mount_namespace", "uid_drop"} & ex.protections:  # kernel-level: also stops libc calls
        raw = ex.run(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.open({str(trainer_dir / 'raw.txt').encode()!r}, 0o101, 0o644), "
            f"libc.unlink({str(cfg_file).encode()!r}))")
        assert raw.text.strip() == "-1 -1", raw.text
    assert snapshot(trainer_dir) == before
    assert {p: p.stat().st_mtime_ns for p in repo_files} == repo_before
    assert not Path("/escape.txt").exists()


def test_trainer_files_are_invisible(ex):
    if "mount_namespace" not in ex.protections:
        pytest.skip("no private mount namespace on this machine")
    r = ex.run(f"import os\nprint(os.path.exists({str(ROOT / 'pyproject.toml')!r}), os.getcwd())")
    assert r.text.split() == ["False", "/sandbox"]


def test_private_directory_is_removed(ex):
    r = ex.run("import os\nopen('scratch.bin', 'wb').write(b'0' * 1000)\nos.makedirs('d/e')\n"
               "open('d/e/f', 'w').write('x')\nos.chmod('d', 0)\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert r.status == "ok" and "['d', 'scratch.bin']" in r.text
    assert [p for p in Path(ex._base).iterdir() if p.name.startswith("run-")] == []


def test_file_size_limit():
    with SandboxExecutor(_cfg(max_file_mb=1)) as ex1:
        r = ex1.run("open('big.bin', 'wb').write(b'0' * (4 << 20))")
    assert r.status == "error" and ("File too large" in r.text or "file size limit" in r.text), r.text


def test_bad_code_never_raises(ex):
    results = ex.run_many([
        "import os\nos._exit(5)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
        "print('\\udcff')",
        "raise KeyboardInterrupt",
        "import sys\nsys.stdout.close()",
    ])
    assert [r.status for r in results[:2]] == ["error", "killed"]
    assert "SIGSEGV" in results[1].text
    assert all(isinstance(r.text, str) for r in results)


def test_parallel_executions_are_bounded(ex):
    """Each execution reports when it ran; at most `workers` (2) ever overlap, and some do."""
    results = ex.run_many(["import time\nt = time.time()\ntime.sleep(0.3)\nprint(t, time.time())"] * 6)
    spans = [tuple(map(float, r.text.split())) for r in results]
    assert len(spans) == 6
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2


def test_weaker_isolation_modes_still_contain():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        none = SandboxExecutor(_cfg(), isolation="none")
    try:
        assert BASE <= none.protections and "mount_namespace" not in none.protections
        ok, net, write = none.run_many(["print(2 ** 10)", "import socket\nsocket.socket()",
                                        f"open({str(ROOT / 'pyproject.toml')!r}, 'a')"])
        assert ok.text == "1024\n"
        assert "network access is disabled" in net.text and "not allowed" in write.text
    finally:
        none.close()
    with pytest.raises(RuntimeError, match="require_isolation"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            SandboxExecutor(_cfg(require_isolation=True), isolation="none")
    try:
        userns = SandboxExecutor(_cfg(), isolation="user_namespace")
    except RuntimeError as err:
        pytest.skip(f"user namespaces unavailable: {err}")
    with userns:
        if "user_namespace" not in userns.protections:
            pytest.skip(f"user namespaces unavailable: {userns.setup_notes}")
        assert {"mount_namespace", "net_namespace", "pid_namespace", "cap_drop"} <= userns.protections
        r = userns.run(f"import os\nprint(os.path.exists({str(ROOT / 'pyproject.toml')!r}), os.getcwd())\n"
                       "import sympy\nprint(sympy.Rational(1, 3) + sympy.Rational(1, 6))")
        assert r.text.split() == ["False", "/sandbox", "1/2"]
