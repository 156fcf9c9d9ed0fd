"""Process-group lifecycle (megatron_alp/runtime/parallel.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from megatron_alp.config import ParallelConfig, RolloutConfig, SamplingConfig
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.rollout import SamplingParams, build_engine

init_distributed(ParallelConfig())
model = make_tiny_model("qwen2", sys.argv[1], seed=0)
cfg = RolloutConfig(dtype="float32", max_model_len=128, engine_process="in_process",
                    sampling=SamplingConfig(max_prompt_length=32, max_response_length=8))
engine = build_engine(cfg, str(model), seed=0)
engine.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=4))
print("generated")
"""


def test_a_process_exits_cleanly_with_an_in_process_engine_still_alive(tmp_path):
    """The trainer's process groups and an in-process vLLM engine's (never shut down) are torn
    down at exit in an order that leaves neither a traceback nor a non-zero status."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0 and "generated" in proc.stdout, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


AFTER_TEARDOWN = """
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_alp.config import ParallelConfig
from megatron_alp.runtime.parallel import init_distributed
init_distributed(ParallelConfig())
dist.destroy_process_group()  # what a finished in-process engine or command may leave behind
init_distributed(ParallelConfig())
assert ps.get_pipeline_model_parallel_rank() == 0 and ps.get_tensor_model_parallel_world_size() == 1
print("re-initialised")
"""


def test_groups_are_made_anew_after_the_world_was_destroyed():
    """Megatron's module globals outlive a destroyed torch.distributed world: the next
    init_distributed in the same process (intervene after a finished run) makes them anew instead of
    reusing groups no longer registered (ValueError on the first rank query)."""
    proc = subprocess.run([sys.executable, "-c", AFTER_TEARDOWN], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "re-initialised" in proc.stdout, proc.stderr[-4000:]


AFTER_VLLM_CPU_WORKER = """
import torch
from megatron_alp.runtime.platform import apply_cpu_shims, reclaim_cpu_streams
assert apply_cpu_shims()
import vllm.v1.worker.cpu.shm  # what an in-process CPU engine's worker imports
assert torch.cuda.Stream().record_event() is None  # vLLM's stand-in: Megatron's MoE dispatcher would wait on it
reclaim_cpu_streams()
stream = torch.cuda.Stream()
assert stream.record_event() is not None and stream is torch.cuda.current_stream()
print("reclaimed")
"""


def test_an_in_process_engine_leaves_megatrons_moe_streams_working():
    """vLLM's CPU worker module replaces torch.cuda's streams with stand-ins whose record_event is
    None; after an in-process engine started, the CPU shim's streams are put back, so an MoE model
    built later in the same process (intervene, then a routing replay) can synchronise."""
    proc = subprocess.run([sys.executable, "-c", AFTER_VLLM_CPU_WORKER], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "reclaimed" in proc.stdout, proc.stderr[-4000:]
