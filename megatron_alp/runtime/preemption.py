"""How a run ends when the cluster ends it: preemption signals, and exit codes the launch scripts read.

SLURM (``--signal``), Kubernetes and the NGC launcher send SIGTERM or SIGUSR1 some time before
they kill a job. :class:`StopRequests` turns either into a request that the trainer honours at the
end of the iteration it is in: it writes a checkpoint and exits with :data:`EXIT_REQUEUE`, which
the launch scripts requeue. Ctrl-C (SIGINT) stays an immediate stop (Python's KeyboardInterrupt),
resuming from the last checkpoint.

torchrun reports any failed worker as exit code 1, so a rank also writes its exit code to the
file named by ``MEGATRON_ALP_EXIT_FILE`` (set by ``launch/torchrun_multinode.sh``), which the script
then exits with.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_alp.runtime.comm import comm_device

EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped for the cluster with a checkpoint; run the same command again
EXIT_HANG = 124  # as timeout(1): a phase ran past trainer.hang_deadline_s
EXIT_FILE_ENV = "MEGATRON_ALP_EXIT_FILE"
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Remembers the first preemption signal this process received (call :meth:`install` from the
    main thread)."""

    def __init__(self):
        self.signal: Optional[str] = None

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    def agreed(self) -> bool:
        """Collective: whether any rank received a preemption signal, so that every rank stops after
        the same iteration (a signal may reach some ranks only, or at different moments)."""
        flag = torch.tensor([1.0 if self.signal else 0.0], device=comm_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Preempted(Exception):
    """The run stopped for a preemption signal after saving ``checkpoint``."""

    def __init__(self, signal_name: str, iteration: int, checkpoint: Path):
        super().__init__(f"{signal_name}: stopped after iteration {iteration - 1} with checkpoint {checkpoint}; "
                         "run the same command again (or let the job requeue) to resume")
        self.checkpoint = checkpoint


def record_exit(code: int) -> None:
    """Write ``code`` to ``$MEGATRON_ALP_EXIT_FILE`` (atomically) for the launch script, if it asked."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(f"{code}\n")
        os.replace(tmp, path)
