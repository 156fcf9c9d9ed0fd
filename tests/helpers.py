"""Shared test helpers: multi-rank checks with torchrun over gloo, trainer runs and their metrics,
and facts more than one test file reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

from megatron_alp.runtime.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None) -> str:
    """Run ``tests/dist/<script>`` on ``nproc`` gloo ranks; fail the test with the output on error."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_port", str(free_port()), str(ROOT / "tests" / "dist" / script), *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} {' '.join(args)} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out


def run_checks(script: str, out: Path) -> dict:
    """Run a test file as a script in a fresh process (one rank, no inherited rendezvous: the CPU
    shims it applies stay out of pytest's process); it records each check's result in ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, script, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def record_checks(checks: dict, path: str) -> None:
    """The script side of :func:`run_checks`: run every check, record each one's result or traceback
    (every check reports; the test of each asserts its own)."""
    results = {}
    for name, fn in checks.items():
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        print(name, "ok" if results[name]["ok"] else "FAILED", flush=True)
    Path(path).write_text(json.dumps(results, default=str))


def passed(results: dict, name: str) -> dict:
    """One check's record from :func:`run_checks`, failing the test with its traceback if it failed."""
    r = results[name]
    assert r["ok"], f"{name} failed:\n{r['error']}"
    return r


def read_results(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one that nobody reaped yet is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone, or going between the open and the read
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------ check scripts, batched per launch
# A torchrun launch costs about 10 s of imports and process-group setup on 2 cores before a check
# script does anything. Test files register their scripts here (dist_job) and read each one's
# folder through the session's DistJobs (tests/conftest.py: dist_jobs): the first test of a file
# that needs a job runs every registered job that file's selected tests need, in as few launches as
# their rank counts, environments and order allow (tests/dist/run_jobs.py runs several scripts in
# one launch). Under pytest-xdist the jobs' folders and outcomes are on disk, shared by the workers:
# a job runs once per test run, in the worker that claimed it first.

import re as _re  # noqa: E402
import signal as _signal  # noqa: E402
import time as _time  # noqa: E402
from dataclasses import dataclass as _dataclass  # noqa: E402

from filelock import FileLock as _FileLock  # noqa: E402


@_dataclass(frozen=True)
class DistJob:
    name: str
    script: str  # under tests/dist/, or a path from the repository root
    args: tuple  # "{dir}": this job's folder; "{dir:NAME}": job NAME's folder
    nproc: int = 2  # 1: a plain one-rank process
    env: tuple = ()  # extra environment, as (key, value) pairs: jobs with other settings launch apart
    after: tuple = ()  # jobs whose folders this one reads
    timeout: int = 600


DIST_JOBS: dict[str, DistJob] = {}


def dist_job(name: str, script: str, *args: str, nproc: int = 2, env: dict | None = None, after: tuple = (),
             timeout: int = 600):
    """Register a check script for the batched launches; returns the mark that tells DistJobs which
    selected tests need it (put it on those tests, or in the module's ``pytestmark``)."""
    import pytest

    DIST_JOBS[name] = DistJob(name, script, tuple(args), nproc, tuple(sorted((env or {}).items())), tuple(after),
                              timeout)
    return pytest.mark.dist_job(name)


class DistJobs:
    """The test run's registered check scripts: ``run(name)`` is the job's folder once it passed, or
    fails the test with its error. ``root`` is shared by every worker of the run: a job's outcome is
    ``_outcomes/<name>.json`` there, and ``_claims/<name>`` names the worker running it."""

    POLL_S = 2.0

    def __init__(self, session, root: Path, worker: str = "main"):
        self.session, self.root, self.worker = session, Path(root), worker
        for sub in ("_outcomes", "_claims", "_launches"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.lock = _FileLock(str(self.root / "_claims.lock"))
        self.outcome: dict[str, str | None] = {}  # None: passed, else why not (as read from disk)

    def dir(self, name: str) -> Path:
        return self.root / name

    def run(self, name: str) -> Path:
        while name not in self._read_outcomes():
            mine = self._claim(name)
            if mine:
                self._run_needed(mine)
            elif name not in self._read_outcomes():
                _time.sleep(self.POLL_S)  # another worker runs it
        if self.outcome[name] is not None:
            raise AssertionError(f"check job {name} failed:\n{self.outcome[name]}")
        return self.dir(name)

    def _read_outcomes(self) -> dict[str, str | None]:
        for f in (self.root / "_outcomes").glob("*.json"):
            if f.stem not in self.outcome:
                self.outcome[f.stem] = json.loads(f.read_text())["error"]
        return self.outcome

    def _record(self, name: str, error: str | None) -> None:
        self.outcome[name] = error
        tmp = self.root / "_outcomes" / f".{name}.tmp"
        tmp.write_text(json.dumps({"error": error, "worker": self.worker}))
        os.replace(tmp, self.root / "_outcomes" / f"{name}.json")

    def _needed(self, name: str) -> set[str]:
        """``name`` and every job the selected tests of the files that use it need, with the jobs
        those read (a file runs on one worker under --dist loadfile: its jobs launch together)."""
        files = {item.path for item in self.session.items
                 if any(m.args[0] == name for m in item.iter_markers("dist_job"))}
        wanted = {name} | {m.args[0] for item in self.session.items if item.path in files
                           for m in item.iter_markers("dist_job")}
        todo = list(wanted)
        while todo:
            for dep in DIST_JOBS[todo.pop()].after:
                if dep not in wanted:
                    wanted.add(dep)
                    todo.append(dep)
        return wanted

    def _claim(self, name: str) -> list[str]:
        """The needed jobs no worker has claimed yet, now claimed by this one (in registration order)."""
        wanted = self._needed(name)
        with self.lock:
            mine = [n for n in DIST_JOBS if n in wanted and not (self.root / "_claims" / n).exists()]
            for n in mine:
                (self.root / "_claims" / n).write_text(self.worker)
        return mine

    def _run_needed(self, mine: list[str]) -> None:
        pending = list(mine)
        while pending:
            done = self._read_outcomes()
            for n in pending:
                failed = [d for d in DIST_JOBS[n].after if d in done and done[d] is not None]
                if failed:
                    self._record(n, f"needs job {failed[0]}, which failed")
            pending = [n for n in pending if n not in self.outcome]
            ready = [n for n in pending if all(d in self.outcome for d in DIST_JOBS[n].after)]
            if not ready:
                if not pending:
                    break
                claimed = {n for n in pending for d in DIST_JOBS[n].after
                           if d not in pending and (self.root / "_claims" / d).exists()}
                if claimed:  # a job they read runs in another worker
                    _time.sleep(self.POLL_S)
                    continue
                for n in pending:
                    self._record(n, "its jobs after= never became ready")
                break
            # first the kind of the ready job with the longest chain of jobs waiting on it
            first = max(ready, key=lambda n: (self._depth(n, pending), -pending.index(n)))
            self._launch(self._group(first, pending))
            pending = [n for n in pending if n not in self.outcome]

    @staticmethod
    def _depth(name: str, pending: list[str]) -> int:
        waiting = [n for n in pending if name in DIST_JOBS[n].after]
        return 1 + max(DistJobs._depth(n, pending) for n in waiting) if waiting else 0

    def _group(self, first: str, pending: list[str]) -> list[str]:
        """``first`` and every pending job of the same kind that can run in the same launch after it."""
        kind = (DIST_JOBS[first].nproc, DIST_JOBS[first].env)
        group: list[str] = []
        for n in pending:
            job = DIST_JOBS[n]
            if (job.nproc, job.env) == kind and all(d in self.outcome or d in group for d in job.after):
                group.append(n)
        return group

    def _args(self, job: DistJob) -> list[str]:
        def sub(m):
            return str(self.dir(m.group(1) or job.name))
        return [_re.sub(r"\{dir(?::(\w+))?\}", sub, a) for a in job.args]

    def _launch(self, group: list[str]) -> None:
        status = self.root / "_launches" / f"{self.worker}-{group[0]}"
        status.mkdir(parents=True)
        plan = []
        for n in group:
            job = DIST_JOBS[n]
            self.dir(n).mkdir(parents=True, exist_ok=True)
            script = ROOT / "tests" / "dist" / job.script if "/" not in job.script else ROOT / job.script
            plan.append({"name": n, "script": str(script), "args": self._args(job)})
        (status / "plan.json").write_text(json.dumps(plan, indent=1))
        first = DIST_JOBS[group[0]]
        runner = str(ROOT / "tests" / "dist" / "run_jobs.py")
        cmd = [sys.executable, runner] if first.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={first.nproc}",
            "--master_port", str(free_port()), runner]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **dict(first.env)}
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        # The launch serves many tests and has its own time limit (its jobs' timeouts together): the
        # per-test limit of pytest-timeout (an interval timer) is paused meanwhile and resumed after.
        paused = _signal.setitimer(_signal.ITIMER_REAL, 0) if hasattr(_signal, "setitimer") else (0.0, 0.0)
        log = status / "output.txt"  # written as the launch runs
        with open(log, "w") as sink:
            proc = subprocess.Popen([*cmd, str(status / "plan.json"), str(status)], cwd=ROOT, env=env, text=True,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=sum(DIST_JOBS[n].timeout for n in group))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            timed_out = True
        except BaseException:  # interrupted: no launch outlives the test that started it
            _kill_group(proc)
            for n in group:
                if n not in self.outcome:
                    self._record(n, "its launch was interrupted")
            raise
        finally:
            if paused[0] > 0:
                _signal.setitimer(_signal.ITIMER_REAL, paused[0], paused[1])
        out = log.read_text() + ("\n(the launch timed out)" if timed_out else "")
        for n in group:
            oks = list(status.glob(f"{n}.rank*.ok"))
            errors = sorted(status.glob(f"{n}.rank*.error"))
            if len(oks) == DIST_JOBS[n].nproc:
                self._record(n, None)
            elif errors or (status / f"{n}.started").exists():
                start = out.find(f"===== job {n}:")
                tail = out[start:] if start >= 0 else out
                self._record(n, "\n".join([e.read_text() for e in errors] + [
                    f"launch rc={proc.returncode}; its output ({log}) from this job on:",
                    tail[-8000:]]))
        if not any(n in self.outcome for n in group):  # the launch ran nothing: no point in another
            for n in group:
                self._record(n, f"the launch ran no job (rc={proc.returncode}):\n{out[-8000:]}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, _signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ------------------------------------------------------------------------------- trainer runs

QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
QUICKSTART_TIR = ROOT / "configs" / "quickstart_tir_cpu.yaml"
QUICKSTART_LORA = ROOT / "configs" / "quickstart_lora_cpu.yaml"

# A CI-sized run: fewer, smaller iterations of the quickstart.
SMALL = [
    "trainer.progress_bar=false",
    "trainer.tensorboard=false",
    "trainer.validate_base=false",
    "trainer.prompts_per_iteration=16",
    "trainer.updates_per_iteration=2",
]
# The shared synchronous run (tests/conftest.py: sync_run) and every run that resumes or extends it:
# 3 iterations, a checkpoint after each, every weight sync verified, the phase ledger written.
SYNC_RUN = ("trainer.iterations=3", "trainer.save_interval=1", "rollout.verify_sync=true", "trainer.phase_ledger=true")
SEPARATE = ("rollout.placement=separate",)  # engines on their own CPU cores (asynchronous runs)
TP2_SP = ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")
PP2 = ("parallel.pipeline_model_parallel_size=2",)

# What a two-rank layout must reproduce of the one-rank run. Rollouts come from the same engine,
# weights and per-sample seeds (rollout.sampling.per_sample_seeds): equal. The unperturbed old-policy
# pass (mismatch/*) differs by fp32 summation order only. The loss forward adds ALP noise drawn per
# (micro-batch, data-parallel rank, pipeline rank, sequence shard), so the first-step loss metrics
# differ by the noise: at most 4e-3 relative with this seed (2e-2 allowed); with
# perturbation.init_std=1e-10 every layout agrees with the one-rank run within 3e-6.
ROLLOUT_KEYS = ("reward/mean", "reward/std", "response_length/mean", "response_length/max",
                "response/truncated_frac")
UNPERTURBED_KEYS = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/pearson_r")
LOSS_KEYS = ("loss/policy", "loss/total", "kl_ref/mean", "entropy/mean", "ratio/p2", "ratio/p50", "ratio/p98",
             "grad_norm")


def train(run_dir: Path, *overrides: str, env: dict | None = None, nproc: int = 1, wait: bool = True,
          config: Path = QUICKSTART):
    """``megatron-alp train`` under torchrun at CI size; ``(returncode, output)``, or the process
    (``wait=False``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_port", str(free_port()), "-m", "megatron_alp.cli", "train", str(config),
           f"trainer.output_dir={run_dir}", *SMALL, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=900)
    return proc.returncode, out


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def copy_run(run: Path, to: Path, base_model_only: bool = False) -> Path:
    """A copy of a shared run to kill, corrupt or resume (the shared one stays as it was); with
    ``base_model_only`` just its warm-started base model, so the copy skips the warm start."""
    if base_model_only:
        shutil.copytree(run / "base_model", to / "base_model")
    else:
        shutil.copytree(run, to, ignore=shutil.ignore_patterns(".lock"))
    return to


# ------------------------------------------------------------------------------- published facts

# Published architecture facts of the models the configs name (config.json of each checkpoint):
# layers, attention heads, KV heads.
MODELS = {
    "Qwen2.5-Math-1.5B": (28, 12, 2),
    "Qwen3-4B": (36, 32, 8),
    "Qwen2.5-7B": (28, 28, 4),
    "Qwen3-30B-A3B-Base": (48, 32, 4),
    "Qwen3-16B-A3B": (48, 32, 4),
    "Qwen2.5-32B": (64, 40, 8),
}


# ------------------------------------------------------------------ rollout engines against a reference
# The vLLM engine tests (tests/test_vllm_engine.py, tests/test_vllm_lora.py) compare an engine's
# logprobs with those of a float32 Hugging Face model on the engine's own tokens.

ENGINE_PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1, 300, 301, 302, 303, 304, 305, 306]]
FP32_TOL = 1e-4  # float32 engine vs float32 transformers on the same tokens: equal up to summation order


def rollout_cfg(**overrides):
    """A float32 engine for tiny models (context 256), with one retry."""
    from megatron_alp.config import RolloutConfig, SamplingConfig

    base = dict(dtype="float32", max_model_len=256, request_timeout_s=120.0, max_retries=1,
                sampling=SamplingConfig(max_prompt_length=64, max_response_length=64))
    return RolloutConfig(**{**base, **overrides})


def hf_model(model_dir, state=None):
    """The float32 Hugging Face model of ``model_dir`` (with ``state`` loaded over its weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


def filtered_log_softmax(logits, temperature=1.0, top_p=1.0, top_k=-1):
    """log of the distribution actually sampled from: tempered, top-k then top-p, renormalised."""
    import torch

    x = logits.double() / temperature
    if top_k > 0:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = x.softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, before >= top_p)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def reference_logprobs(model, completion, **sampling):
    """The reference model's logprobs of a completion's response tokens under ``sampling``."""
    import torch

    ids = completion.prompt_ids + completion.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    p = len(completion.prompt_ids)
    logp = filtered_log_softmax(logits[p - 1: -1], **sampling)
    return logp.gather(-1, torch.tensor(completion.response_ids).unsqueeze(-1)).squeeze(-1)


def max_diff(model, groups, **sampling) -> float:
    """max |engine logprob - reference logprob| over every sampled token of ``groups``."""
    import torch

    return max(
        (reference_logprobs(model, c, **sampling) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
        for g in groups for c in g
    )


def kill_engine(engine, timeout: float = 30.0) -> None:
    """SIGKILL an engine's engine-core process(es) and wait until they are gone, and vLLM's workers
    they started with them (a worker ends when it sees its parent gone; a restarted engine must
    not meet it). The shared-memory janitors (megatron_alp/runtime/shm_janitor.py) outlive them by
    design."""
    import signal
    import time

    import psutil

    pids = engine.engine_pids()
    assert pids, "the engine core should run in its own process"
    family = list(pids)
    for pid in pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            try:
                if not any(arg.endswith("shm_janitor.py") for arg in child.cmdline()):
                    family.append(child.pid)
            except psutil.Error:  # gone already
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it has ended already
            pass
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(running(pid) for pid in family), "the killed engine's processes are still running"


def cli_printed(argv: list[str]) -> tuple[int, str]:
    """``megatron-alp ARGV`` in this process, with everything written to descriptor 1 and to
    ``sys.stdout`` meanwhile (the terminal's lines): ``(exit status, that text)``. For session
    fixtures, which cannot use capfd."""
    import contextlib
    import tempfile

    from megatron_alp.cli import main as cli_main

    with tempfile.TemporaryFile(mode="w+") as out:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        stream = os.fdopen(os.dup(1), "w", buffering=1)
        try:
            with contextlib.redirect_stdout(stream):
                rc = cli_main(argv)
        finally:
            stream.close()
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return rc, out.read()

