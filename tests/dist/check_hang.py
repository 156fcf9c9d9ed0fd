"""A rank that stops answering: both ranks end within the deadline, saying who did not arrive.

Rank 1 stops as it enters the logprob phase of iteration 1 (MEGATRON_ALP_HANG_AT); rank 0 goes on
to the update and waits in a collective for rank 1, as a rank waiting on a dead peer does.

Usage: torchrun --nproc_per_node 2 check_hang.py RUN_DIR DEADLINE_S
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_alp.runtime.preemption import StopRequests
from megatron_alp.trainer.hang_watch import HangWatch
from megatron_alp.plan.phases import PHASES
from megatron_alp.trainer.phases import PhaseRunner

run_dir, deadline = Path(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
StopRequests().install()  # as `megatron-alp train` does: torchrun's SIGTERM to the others does not cut their report
runner = PhaseRunner(watch=HangWatch(deadline, run_dir, rank, list(PHASES)))
for iteration in range(2):
    runner.iteration = iteration
    for phase in ("rollout", "logprob", "policy_update"):
        runner.enter(phase)
    dist.all_reduce(torch.ones(1))  # the update's gradient reduction: the ranks meet once per iteration
print("not reached", flush=True)
sys.exit(3)
