"""GPU self-test: a ~0.5B random Qwen2 trained for 3 RL iterations in each GPU configuration the
machine allows, with throughput, weight-sync time, and the memory of every phase of the phase table
measured (``trainer.phase_ledger``) beside `megatron-alp plan`'s estimate of it.

    bash launch/gpu_selftest.sh            # or: python benchmarks/gpu_selftest.py [--out DIR]

Variants: vLLM bf16 rollouts, vLLM FP8 rollouts, and sequence packing (THD layout into Transformer
Engine attention, 4096-token packed rows) on one GPU; with 2+ GPUs also TP=2 and DP=2
(torchrun); SGLang when it is installed (see rollout.sglang_python). Each variant is a real
`megatron-alp train` run (Transformer Engine layer spec, colocated engine with sleep mode and
training-state offload); a variant that fails is reported with the end of its log and the script
exits non-zero. Nothing here runs without a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.plan.estimates import GiB
from megatron_alp.plan.memory import memory_plan
from megatron_alp.plan.phases import PHASES
from megatron_alp.resolve import load_config
from megatron_alp.rollout.sglang_engine import sglang_python
from megatron_alp.runtime.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]
# ~0.46B parameters: 24 layers of hidden 1024 / MLP 5504 (the tiny tokenizer keeps the vocabulary small).
MODEL = dict(hidden_size=1024, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=2, max_position_embeddings=2048)
COMMON = [
    "model.tiny=null", "model.dtype=bfloat16", "model.layer_spec=auto", "trainer.sft_warmup_steps=0",
    "trainer.iterations=3", "trainer.save_interval=3", "trainer.prompts_per_iteration=64",
    "trainer.updates_per_iteration=2", "trainer.micro_batch_size=8", "trainer.progress_bar=false",
    "trainer.tensorboard=false", "trainer.eval_interval=0", "rollout.sampling.n=8",
    "rollout.sampling.max_response_length=256", "rollout.gpu_memory_utilization=0.4",
    "rollout.enforce_eager=false", "rollout.verify_sync=true", "trainer.phase_ledger=true",
]
REPORT = [("rollout tok/s", "throughput/rollout_tokens_per_s"), ("step s", "timing/total_s"),
          ("sync s", "sync/seconds"), ("offload s", "offload/seconds"),
          ("GPU used GiB rollout", "memory/rollout_used_gib"), ("peak GiB logprob", "memory/logprob_peak_gib"),
          ("peak GiB update", "memory/update_peak_gib"), ("peak GiB sync", "memory/sync_peak_gib")]


def variants(gpus: int) -> dict[str, tuple[int, list[str]]]:
    out = {"vllm bf16": (1, []), "vllm fp8": (1, ["rollout.quantization=fp8"]),
           "packed thd": (1, ["trainer.max_tokens_per_micro_batch=4096", "trainer.sequence_packing=true"])}
    if gpus >= 2:
        out["vllm tp2"] = (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                               "rollout.tensor_parallel_size=2"])
        out["vllm dp2"] = (2, [])
    probe = subprocess.run([sglang_python(RolloutConfig()), "-c", "import sglang"], capture_output=True)
    if probe.returncode == 0:
        out["sglang bf16"] = (1, ["rollout.engine=sglang", "rollout.sampling.per_sample_seeds=false"])
    return out


def run_variant(name: str, nproc: int, overrides: list[str], model: Path, out: Path) -> dict:
    run_dir = out / name.replace(" ", "_")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), "-m", "megatron_alp.cli", "train", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"model.hf_path={model}", f"trainer.output_dir={run_dir}", *COMMON, *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        log = run_dir / "logs" / "engine.log"
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        return {"ok": False, "wall_s": wall, "error": (proc.stdout + proc.stderr)[-4000:] + "\n" + tail}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]  # the first iteration includes the engine's warm-up
    return {"ok": True, "wall_s": wall, **{label: last.get(key) for label, key in REPORT},
            "phases": phase_memory(run_dir, nproc)}


def phase_memory(run_dir: Path, nproc: int) -> dict[str, dict]:
    """Per phase of the table: the most GPU memory in use at its entry or exit on any rank, the
    trainer allocator's peak inside it, and the plan's estimate of its row (which calibrates the plan)."""
    measured: dict[str, dict] = {}
    for ledger in sorted((run_dir / "phase_ledger").glob("rank_*.jsonl")):
        for line in ledger.read_text().splitlines():
            row = json.loads(line)
            m = measured.setdefault(row["phase"], {"used_gib": 0.0, "trainer_peak_gib": 0.0})
            m["used_gib"] = max(m["used_gib"], row.get("gpu_used_gib", 0.0))
            m["trainer_peak_gib"] = max(m["trainer_peak_gib"], row.get("trainer_peak_gib", 0.0))
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB
    plan = memory_plan(load_config(run_dir / "config.yaml"), nproc, gpu_gib)
    for name, m in measured.items():
        row = plan.phase(PHASES[name].plan_row)
        m["plan_gib"] = None if row.not_run else row.total / GiB
    return measured


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary folder)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_selftest: no CUDA GPU on this machine; nothing to test", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_selftest_"))
    model = make_tiny_model("qwen2", out / "model_0.5b", seed=0, dtype="bfloat16", **MODEL)
    print(f"{torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}; runs in {out}", flush=True)
    results = {}
    for name, (nproc, overrides) in variants(gpus).items():
        results[name] = run_variant(name, nproc, overrides, model, out)
        status = "ok" if results[name]["ok"] else "FAILED"
        print(f"{name}: {status} in {results[name]['wall_s']:.0f} s", flush=True)
    labels = [label for label, _ in REPORT]
    print("\n| variant | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name, r in results.items():
        cells = [f"{r[label]:.3g}" if isinstance(r.get(label), (int, float)) else "-" for label in labels]
        print(f"| {name} | " + " | ".join(cells if r["ok"] else ["FAILED"] * len(labels)) + " |")
    for name, r in results.items():
        if r["ok"]:
            print(f"\n{name}: memory per phase (GiB; GPU in use: the most at the phase's entry or exit on any rank)")
            print("| phase | GPU in use | trainer peak | plan |\n|---|---|---|---|")
            for phase, m in r["phases"].items():
                plan = f"{m['plan_gib']:.2f}" if m["plan_gib"] is not None else "-"
                print(f"| {phase} | {m['used_gib']:.2f} | {m['trainer_peak_gib']:.2f} | {plan} |")
    for name, r in results.items():
        if not r["ok"]:
            print(f"\n--- {name} failed:\n{r['error']}")
    (out / "gpu_selftest.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
