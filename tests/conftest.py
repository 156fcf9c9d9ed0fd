"""Test-wide settings (CPU vLLM in-process and small, tests/ importable), the expensive artefacts
every test run makes once and shares (session fixtures), and the suite's budget report."""

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SYNC_RUN, copy_run, train  # noqa: E402
for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # an engine holding other memory than its phase's is an error in tests (megatron_alp/trainer/phases.py)
    "MEGATRON_ALP_STRICT_PHASES": "1",
}.items():
    os.environ.setdefault(key, value)


# the rendezvous of a one-process group (runtime/parallel.py: init_distributed puts it in the
# environment): read once, when the group is made
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_inherited_rendezvous():
    """Groups this process made (some test modules make one when imported) leave their rendezvous
    in the environment; a command a test starts would inherit it and try to bind the port this
    process still listens on. The live groups no longer need it."""
    for key in RENDEZVOUS:
        os.environ.pop(key, None)
    yield
    for key in RENDEZVOUS:
        os.environ.pop(key, None)


# ------------------------------------------------------------------------------- shared runs
# Made once per test run, on first use, and read by many tests; a test that kills, corrupts or
# resumes one works on a copy (helpers.copy_run).

def shared_dir(tmp_path_factory, name: str) -> Path:
    """The folder of one artefact shared by the whole test run. Under pytest-xdist every worker has a
    base temp folder of its own below one common parent: the artefact lives in that parent, so the
    workers share it (see :func:`made_once`)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / name


def made_once(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` run once per test run, whichever worker asks first; the others wait for it
    and read the same folder. A failed make is tried again by the next worker that asks (and fails
    its tests the same way)."""
    folder = shared_dir(tmp_path_factory, name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        done = folder / ".made"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def _train_into(run: Path, *overrides: str, nproc: int = 1) -> None:
    rc, out = train(run, *overrides, nproc=nproc)
    assert rc == 0, out[-6000:]
    (run / "terminal.txt").write_text(out)


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory) -> Path:
    """The quickstart at CI size on one rank (helpers.SMALL + SYNC_RUN): its own 100-step warm start,
    3 iterations of 16 prompts x 8 samples, a checkpoint after each, validation after the last. The
    reference the two-rank layouts reproduce, and the warm-started base model of the other runs.
    Its terminal output is in terminal.txt."""
    return made_once(tmp_path_factory, "sync_run", lambda d: _train_into(d / "run", *SYNC_RUN)) / "run"


@pytest.fixture(scope="session")
def dp2_run(sync_run, tmp_path_factory) -> Path:
    """The first 2 iterations of :func:`sync_run` on 2 data-parallel ranks, from the same base model."""
    def make(folder: Path) -> None:
        run = copy_run(sync_run, folder / "run", base_model_only=True)
        _train_into(run, *SYNC_RUN, "trainer.iterations=2", nproc=2)

    return made_once(tmp_path_factory, "dp2_run", make) / "run"


@pytest.fixture(scope="session")
def dist_jobs(request, tmp_path_factory):
    """The check scripts test files register (helpers.dist_job), run together in as few launches as
    they allow the first time a test of a file needs one, once per test run whichever xdist worker
    asks: ``dist_jobs.run(name)`` is that job's folder."""
    from helpers import DistJobs

    return DistJobs(request.session, shared_dir(tmp_path_factory, "dist_jobs"),
                    worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_configure(config):
    config.addinivalue_line("markers", "dist_job(name): the test reads the check job registered as name "
                                       "(helpers.dist_job)")


# ------------------------------------------------------------------------------- tiny models

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(family, seed=0, **overrides)``: megatron_alp.models.tiny's Hugging Face model
    folder (weights, config, tokenizer), made once per test run for each set of arguments and
    shared. Read-only: a test that changes one works on a copy."""
    def get(family: str, seed: int = 0, **overrides) -> Path:
        from megatron_alp.models.tiny import make_tiny_model

        name = "_".join([f"tiny_{family}", f"seed{seed}", *(f"{k}{v}" for k, v in sorted(overrides.items()))])
        return made_once(tmp_path_factory, name,
                         lambda d: make_tiny_model(family, d / "model", seed=seed, **overrides)) / "model"

    return get


# The suite's own budget report (tests/README.md): the wall time of the run, each xdist worker's busy
# time (their difference is the tail one worker spent alone), the longest files and every test over
# SLOW_TEST_S (setup, which builds shared fixtures, included), so the change that adds minutes is seen
# in the run that adds them. A report, not a failing timed test.
SLOW_TEST_S = 60.0
_started = time.monotonic()
_test_seconds: dict[str, float] = {}
_worker_seconds: dict[str, float] = {}

# The files that take longest, started first: pytest-xdist (--dist loadfile --no-loadscope-reorder)
# hands files to the two workers in collection order, so the run ends on short files and neither
# worker waits long for the other. test_trainer.py first: it makes the shared quickstart run that
# test_trainer_lora.py and test_phases.py copy, before they start.
LONGEST_FIRST = ("test_trainer.py", "test_convert.py", "test_vllm_engine.py", "test_comm.py", "test_trainer_lora.py",
                 "test_weight_sync.py", "test_vllm_lora.py", "test_intervene.py", "test_routing_replay.py",
                 "test_lora.py", "test_mismatch.py", "test_evaluate.py", "test_calibration.py", "test_micro_batch.py",
                 "test_policy_update.py", "test_layer_divergence.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the others keep their order


def pytest_runtest_logreport(report):
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
    _worker_seconds[worker] = _worker_seconds.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    markers = config.getoption("markexpr") or "all"
    files: dict[str, float] = {}
    for nodeid, seconds in _test_seconds.items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + seconds
    longest = ", ".join(f"{f} {s:.0f} s" for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:8])
    busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(_worker_seconds.items()))
    over = sorted(((s, n) for n, s in _test_seconds.items() if s > SLOW_TEST_S), reverse=True)
    listed = "; ".join(f"{n} {s:.0f} s" for s, n in over) or "none"
    terminalreporter.write_line(f"suite budget: {len(_test_seconds)} tests ({markers}) in "
                                f"{time.monotonic() - _started:.0f} s wall (busy: {busy}); longest files: "
                                f"{longest}; over {SLOW_TEST_S:.0f} s: {listed}")
