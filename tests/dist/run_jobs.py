"""Run several check scripts in one launch (tests/helpers.py: DistJobs): the imports and the
process-group setup (about 10 s a launch on 2 cores) are paid once instead of once per script.

Usage: torchrun --nproc_per_node 2 run_jobs.py PLAN.json STATUS_DIR   (or python run_jobs.py ... on one rank)

PLAN.json is a list of ``{"name", "script", "args"}``. Each script runs as ``__main__`` with
``sys.argv = [script, *args]``, as it would in a launch of its own: the torch default generator is
reset to a fresh process's seed before it, and whatever it patched in the modules of megatron_alp
(the functions and classes it replaced) is put back after it. Each job leaves ``<name>.started`` and,
on every rank that finished it, ``<name>.rank<R>.ok`` in STATUS_DIR; a job that raises writes its
traceback to ``<name>.rank<R>.error`` and ends the launch (the other rank may be waiting in one of
its collectives), and the launcher starts the jobs not yet run in a new launch.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

FRESH_SEED = torch.initial_seed()
# the modules the check scripts patch, loaded before the first job so that their state is saved
PATCHED = ("megatron_alp.training.policy_update", "megatron_alp.training.perturbation", "megatron_alp.training.policy",
           "megatron_alp.models.routing")
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _patchable() -> dict:
    """The attributes a check script may patch: every megatron_alp module's and class's."""
    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron_alp" or name.startswith("megatron_alp.")):
            continue
        attrs = dict(vars(module))
        state[module] = attrs
        for value in attrs.values():
            if isinstance(value, type) and value.__module__ == name:
                state[value] = dict(vars(value))
    return state


def _restore(before: dict) -> None:
    """Put back the functions and classes a job replaced (state a module keeps for itself, such as
    whether the CPU shims are applied, stays as the job left it)."""
    for owner, attrs in before.items():
        now = vars(owner)
        for key, value in attrs.items():
            if key in ("__dict__", "__weakref__") or now.get(key, _MISSING) is value:
                continue
            if inspect.isfunction(value) or inspect.isclass(value):
                setattr(owner, key, value)


_MISSING = object()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def main() -> None:
    import importlib

    for module in PATCHED:
        importlib.import_module(module)
    plan, status = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    one_rank = int(os.environ.get("WORLD_SIZE", "1")) == 1 and "LOCAL_RANK" not in os.environ
    for job in plan:
        name = job["name"]
        if int(os.environ.get("RANK", "0")) == 0:
            (status / f"{name}.started").write_text("")
        if _rank() == 0:
            print(f"===== job {name}: {job['script']} {' '.join(job['args'])}", flush=True)
        started = time.monotonic()
        before = _patchable()
        saved_argv, saved_cwd = sys.argv, os.getcwd()
        sys.argv = [job["script"], *job["args"]]
        torch.manual_seed(FRESH_SEED)
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                _fail(status, name, f"exited with status {exit_.code}")
        except BaseException:
            _fail(status, name, traceback.format_exc())
        finally:
            sys.argv = saved_argv
            os.chdir(saved_cwd)
            _restore(before)
        gc.collect()
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        elif one_rank and not dist.is_initialized():
            for key in RENDEZVOUS:  # a job that tore its group down: the next one makes a new one
                os.environ.pop(key, None)
        (status / f"{name}.rank{_rank()}.ok").write_text("")
        if _rank() == 0:
            print(f"===== job {name}: ok ({time.monotonic() - started:.1f} s)", flush=True)


def _fail(status: Path, name: str, error: str) -> None:
    print(f"===== job {name}: FAILED\n{error}", flush=True)
    (status / f"{name}.rank{_rank()}.error").write_text(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    main()
