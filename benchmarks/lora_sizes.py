"""What LoRA saves against full training on the CPU quickstart model, side by side in one run.

Three CI-sized runs of ``megatron-alp train`` (one iteration, a checkpoint after it, a 30-step warm
start, no validation, 16 prompts, one update), each in ``OUT/<run>`` with its terminal output in
``OUT/<run>/train.log``:

- ``full``: ``--full-config`` (default configs/quickstart_cpu.yaml): every weight trains;
- ``lora_merged``: ``--lora-config`` (default configs/quickstart_lora_cpu.yaml) with
  ``lora.sync=merged``: the engine receives the merged weights W + (alpha/rank) B A;
- ``lora_adapter``: the same with ``lora.sync=adapter``: the engine receives A and B only.

The full run creates and warm-starts the base model; its ``base_model/`` is copied into the LoRA runs
before they start, so all three train from the same weights and the warm start happens once (the two
configs share model, warm start and seed). Extra ``KEY=VALUE`` overrides apply to all three runs.

Per run (``OUT/results.json``, ``runs``), from the checkpoint written after the iteration and from
``metrics.jsonl``:

- ``trainable_params``: elements of every ``optimizer.state.exp_avg.*`` tensor: Adam keeps one per
  trainable parameter, so this is the full model for ``full`` and the adapters plus ALP's per-layer
  sigmas for LoRA (``sigma_params``: the sigmas' share);
- ``optimizer_bytes``: bytes of every tensor under ``optimizer.`` keys, numel x dtype size read from
  the distributed checkpoint's metadata (``FileSystemReader(ckpt).read_metadata()``);
- ``model_bytes``: bytes of the model tensors, the other keys, read the same way: every weight for
  ``full``; for LoRA the adapters and sigmas alone, as its checkpoints leave the frozen base out and
  record its folder and fingerprint instead;
- ``checkpoint_bytes``: every file of the checkpoint directory (model, optimizer, ``hf/``, metadata).
  A LoRA checkpoint took 4.338 MiB here while it held the base too (3.258 MiB of it), 1.019 MiB
  without it; the full one 10.033 MiB;
- ``sync_bytes``: ``sync/bytes`` per iteration, what the trainer sends the engine;
- ``s_per_iteration`` / ``update_s``: ``timing/total_s`` / ``timing/update_s``. One iteration on a
  shared CPU: indicative only.

The table lists each number per run and ``full / LoRA`` for both LoRA runs: how many times smaller
LoRA's is (above 1: LoRA saves). Parameters, optimizer state and checkpoint are the same for both
LoRA runs (only the sync differs); the sync row is where merged (the whole model, like full) and
adapter-only part ways.

    python benchmarks/lora_sizes.py                                  # about 7 minutes on 2 cores
    python benchmarks/lora_sizes.py --out /tmp/ls trainer.sft_warmup_steps=2   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_alp.config import ConfigError, read_config  # noqa: E402
from megatron_alp.trainer.run_dir import checkpoint_dir  # noqa: E402
from train_run import train  # noqa: E402  (benchmarks/ is not a package)

CI = ["trainer.iterations=1", "trainer.save_interval=1", "trainer.sft_warmup_steps=30", "trainer.eval_interval=0",
      "trainer.validate_base=false", "trainer.progress_bar=false", "trainer.prompts_per_iteration=16",
      "trainer.updates_per_iteration=1"]
RUNS = {"full": [], "lora_merged": ["lora.sync=merged"], "lora_adapter": ["lora.sync=adapter"]}
ROWS = [("trainable parameters", "trainable_params", "{:,.0f}"),
        ("optimizer state (MiB)", "optimizer_bytes", "{:.3f}"),
        ("model tensors saved (MiB)", "model_bytes", "{:.3f}"),
        ("checkpoint on disk (MiB)", "checkpoint_bytes", "{:.3f}"),
        ("weight sync / iteration (MiB)", "sync_bytes", "{:.3f}"),
        ("time / iteration (s)", "s_per_iteration", "{:.2f}"),
        ("update / iteration (s)", "update_s", "{:.2f}")]
MIB = 2**20


def checkpoint_numbers(ckpt: Path) -> dict:
    """Trainable parameters (their ``exp_avg`` elements), ALP sigmas among them, optimizer-state bytes
    and model-tensor bytes, from a distributed checkpoint's metadata alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = sigmas = optimizer = model = 0
    for key, md in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        numel = math.prod(md.size)
        if not key.startswith("optimizer."):
            model += numel * md.properties.dtype.itemsize
            continue
        optimizer += numel * md.properties.dtype.itemsize
        if key.startswith("optimizer.state.exp_avg."):
            params += numel
            sigmas += numel if key.endswith("log_sigma") else 0
    return {"trainable_params": params, "sigma_params": sigmas, "optimizer_bytes": optimizer, "model_bytes": model}


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mean_of(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the training iterations (``iteration >= 0``) of metrics.jsonl."""
    xs = [r[key] for r in rows if r.get("iteration", -1) >= 0 and key in r]
    return sum(xs) / len(xs) if xs else math.nan


def run_numbers(run_dir: Path, iterations: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = checkpoint_dir(run_dir, iterations)
    return {"checkpoint": str(ckpt), **checkpoint_numbers(ckpt), "checkpoint_bytes": dir_bytes(ckpt),
            "sync_bytes": mean_of(rows, "sync/bytes"), "s_per_iteration": mean_of(rows, "timing/total_s"),
            "update_s": mean_of(rows, "timing/update_s")}


def table(runs: dict[str, dict], ratios: dict[str, dict]) -> str:
    """One row per number: each run's value, then ``ratios`` (full / LoRA) for both LoRA runs."""
    names = list(runs)
    lines = [f"{'':<31}" + "".join(f"{n:>15}" for n in names) + "".join(f"{'full/' + n:>19}" for n in names[1:])]
    for label, key, fmt in ROWS:
        scale = MIB if key.endswith("_bytes") else 1
        line = f"{label:<31}" + "".join(f"{fmt.format(runs[n][key] / scale):>15}" for n in names)
        line += "".join(f"{ratios[n][key]:>18.2f}x" for n in ratios)
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full-config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml")
    p.add_argument("--lora-config", type=Path, default=ROOT / "configs" / "quickstart_lora_cpu.yaml")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lora_sizes")
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    taken = [name for name in RUNS if (out / name).exists()]
    if taken:  # a run directory resumes: the numbers would mix with the earlier run's
        raise SystemExit(f"lora_sizes: {out} already holds {', '.join(taken)}: choose another --out")
    overrides = CI + args.overrides
    configs = {name: args.full_config if name == "full" else args.lora_config for name in RUNS}
    try:  # every run's config, before minutes of training; the checkpoint to read is the last iteration's
        iterations = {name: read_config(configs[name], overrides + extra).trainer.iterations
                      for name, extra in RUNS.items()}
    except ConfigError as err:
        raise SystemExit(f"lora_sizes: {err}") from None
    runs = {}
    for name, extra in RUNS.items():
        run_dir, config = out / name, configs[name]
        run_dir.mkdir(parents=True)
        if name != "full":
            shutil.copytree(out / "full" / "base_model", run_dir / "base_model")
        print(f"{name}: training {' '.join([config.name, *extra])} ...", flush=True)
        took = train(config, run_dir, overrides + extra)
        runs[name] = run_numbers(run_dir, iterations[name])
        print(f"{name}: done in {took:.0f} s", flush=True)

    ratios = {n: {key: runs["full"][key] / runs[n][key] for _, key, _ in ROWS} for n in list(RUNS)[1:]}
    results = {"full_config": str(args.full_config), "lora_config": str(args.lora_config), "overrides": overrides,
               "runs": runs, "full_over": ratios}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(runs, ratios) + "\n")
    print(f"wrote {out / 'results.json'}; runs in {out}/{{{','.join(RUNS)}}} (train.log, metrics.jsonl, checkpoints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
