"""Peak memory of the checkpoint converters: streaming vs. whole-model, side by side, one run.

Builds a mid-size random Qwen2-architecture HF checkpoint (bf16, sharded safetensors), then runs
each conversion in its own fresh process and reports its peak resident memory above the
process's baseline (interpreter, torch and Megatron imported, process group up; the kernel's
high-water mark is reset there through ``/proc/self/clear_refs``):

- ``hf-to-mcore streaming``: :mod:`checkpoint_tools.hf_to_mcore` (reads one parameter's HF
  tensors at a time, closes each shard file when done);
- ``hf-to-mcore whole``: the usual approach -- load every HF shard into one state dict, then
  fill the model and save;
- ``mcore-to-hf streaming``: :mod:`checkpoint_tools.mcore_to_hf` (tensors stream into
  safetensors shards of at most the HF shard size);
- ``mcore-to-hf whole``: gather the whole HF state dict, then write it.

Both directions must hold the Megatron model stage itself (``model`` below); what streaming
saves is the second copy. "extra" = peak above baseline minus the model stage: it should stay
near the largest HF shard for streaming and near the whole model for the whole-model approach.

Usage: python benchmarks/bench_convert.py [--hidden 768 --layers 12 --vocab 32000 --shard-mb 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model(out: Path, hidden: int, layers: int, vocab: int, shard_mb: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen2", hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), vocab_size=vocab,
        tie_word_embeddings=False, max_position_embeddings=1024, architectures=["Qwen2ForCausalLM"],
    )
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=f"{shard_mb}MB", safe_serialization=True)


# ----------------------------------------------------------------------- measured child process


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Restart the kernel's resident-memory high-water mark (VmHWM) from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(mode: str, src: str, dst: str, shard_bytes: int) -> dict:
    """Runs in a fresh process: set up, take the baseline, convert, report peaks."""
    import torch

    from checkpoint_tools import parallel_config
    from megatron_alp.models.hf_weights import iter_hf_weights, local_params, open_hf_checkpoint
    from megatron_alp.models.sharding import shard
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.training.dist_checkpoint import load_checkpoint, read_metadata, save_checkpoint
    from megatron_alp.training.export import weightless_model

    par = parallel_config(1, 1, 1, moe=False)
    init_distributed(par)
    import transformers  # noqa: F401  (imported by the converters; part of the baseline)
    from safetensors.torch import load_file, save_file

    _reset_peak()
    baseline = _status_kib("VmRSS") << 10
    if mode.startswith("hf-to-mcore"):
        if mode == "hf-to-mcore streaming":
            from checkpoint_tools.hf_to_mcore import convert

            convert(src, dst, par, layer_spec="local")
        else:
            hf_config, mapping, ckpt = open_hf_checkpoint(src)
            full = {}
            for f in sorted(set(ckpt.location.values())):
                full.update(load_file(str(f)))
            model = weightless_model(hf_config, par, "bfloat16", "local", source=src)
            with torch.no_grad():
                for p in local_params(model, mapping):
                    t = mapping.to_mcore(p.match, [full[n] for n in p.match.hf_names])
                    p.param.copy_(shard(t, p.match.name, p.partition_dim, p.tp_rank, p.tp_size, gated=True))
            save_checkpoint(dst, model, hf_config=hf_config, hf_dir=src)
    else:
        if mode == "mcore-to-hf streaming":
            from checkpoint_tools.mcore_to_hf import convert

            convert(src, dst, par, layer_spec="local", max_shard_bytes=shard_bytes)
        else:
            meta = read_metadata(src)
            model = weightless_model(meta["hf_config"], par, meta["dtype"], "local", source=src)
            load_checkpoint(src, model)
            state = {n: t.clone() for n, t in iter_hf_weights(model)}
            Path(dst).mkdir()
            save_file(state, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return {"baseline": baseline, "peak": _status_kib("VmHWM") << 10}


def measure(mode: str, src: Path, dst: Path, shard_bytes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", mode, str(src), str(dst), str(shard_bytes)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=50)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()

    from safetensors import safe_open

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "hf"
    if not hf.exists():
        make_model(hf, args.hidden, args.layers, args.vocab, args.shard_mb)
    files = sorted(hf.glob("*.safetensors"))
    model_bytes, largest_tensor = 0, 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                n = h.get_slice(k)
                shape = n.get_shape()
                size = 2
                for s in shape:
                    size *= s
                model_bytes += size
                largest_tensor = max(largest_tensor, size)
    largest_file = max(f.stat().st_size for f in files)
    mb = 1 << 20
    print(f"model: {model_bytes / mb:.0f} MiB bf16 in {len(files)} safetensors files "
          f"(largest file {largest_file / mb:.0f} MiB, largest tensor {largest_tensor / mb:.0f} MiB)")
    print(f"{'conversion':<24}{'peak above baseline':>22}{'extra beyond model':>22}{'extra / largest file':>24}")
    rows = {}
    for mode, src, dst in [
        ("hf-to-mcore streaming", hf, work / "mcore_stream"),
        ("hf-to-mcore whole", hf, work / "mcore_whole"),
        ("mcore-to-hf streaming", work / "mcore_stream", work / "hf_stream"),
        ("mcore-to-hf whole", work / "mcore_stream", work / "hf_whole"),
    ]:
        shutil.rmtree(dst, ignore_errors=True)
        r = measure(mode, src, dst, largest_file)
        above = r["peak"] - r["baseline"]
        extra = above - model_bytes
        rows[mode] = {"above_baseline_mib": above / mb, "extra_mib": extra / mb}
        print(f"{mode:<24}{above / mb:>19.0f} MiB{extra / mb:>19.0f} MiB{extra / largest_file:>23.2f}x")
    for direction in ("hf-to-mcore", "mcore-to-hf"):
        s, w = rows[f"{direction} streaming"]["extra_mib"], rows[f"{direction} whole"]["extra_mib"]
        print(f"{direction}: streaming needs {s:.0f} MiB beyond the model, whole-model {w:.0f} MiB "
              f"({w / max(s, 1e-9):.1f}x more)")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        mode, src, dst, shard_bytes = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        print(json.dumps(child(mode, src, dst, shard_bytes)))
    else:
        main()
