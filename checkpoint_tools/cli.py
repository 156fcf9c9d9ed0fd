"""``megatron-alp convert {hf-to-mcore,mcore-to-hf,mcore-to-peft,reshard,quantize,verify}``.

Each action runs on as many ranks as its layout needs (``--tp``, ``--pp``, ``--ep``). Started
plainly, a command that needs more than one rank launches itself through
``python -m torch.distributed.run`` on this machine; started under ``torchrun`` (e.g. for several
nodes), it runs in place. Inputs are checked before any rank starts, so a wrong architecture, a
missing shard or a layout that does not divide the model fails at once with the file or field
named. Outputs are written to ``<out>.tmp-XXXX`` and renamed when complete; a failed run leaves
no ``<out>``. Checkpoints record their HF config and tokenizer (trainer checkpoints and converted
ones alike), so the export needs no other input; ``--hf-ref`` supplies them for older checkpoints.
A checkpoint trained with LoRA exports the merged model (``mcore-to-hf``) or its adapters alone as
a PEFT adapter directory (``mcore-to-peft``), the adapters' config read from its metadata. Such a
checkpoint holds no base weights: every action reads them from the base folder it records, checked
against the recorded fingerprint before any rank starts; ``--base DIR`` names the folder when it moved.
Library output goes to ``<out>.convert.log`` (verify: ``<mcore>.verify.log``); the terminal gets
errors and one line saying what was written where.

Examples::

    megatron-alp convert hf-to-mcore --hf Qwen2.5-7B --out ckpt/qwen7b --tp 2 --pp 1
    megatron-alp convert mcore-to-hf --mcore runs/x/checkpoints/iter_0000100 --out hf_out
    megatron-alp convert mcore-to-peft --mcore runs/x/checkpoints/iter_0000100 --out adapter --base-model Qwen/Qwen3-8B
    megatron-alp convert mcore-to-hf --mcore runs/x/checkpoints/iter_0000100 --out hf_out --base /models/Qwen3-8B
    megatron-alp convert reshard --mcore ckpt/qwen7b --out ckpt/qwen7b_pp2 --tp 1 --pp 2
    megatron-alp convert verify --hf Qwen2.5-7B --mcore ckpt/qwen7b --tp 2
    megatron-alp convert quantize --mcore runs/x/checkpoints/iter_0000100 --out qwen7b_fp8 --format fp8 \
        --calib data/train.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import checkpoint_tools
from megatron_alp.runtime.console import held_warnings, library_output_to, say, say_error
from megatron_alp.runtime.parallel import free_port

BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, KeyError)


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1048576")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index(m.group(2) or "B"))


def _base_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None, metavar="DIR",
                   help="a LoRA checkpoint's base model folder, when it moved from the one the checkpoint records "
                   "(its weights must be the same)")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default 1)")
    p.add_argument("--layer-spec", default="auto", choices=["auto", "local", "te"],
                   help="Megatron layer implementation (auto: TE on a GPU with transformer-engine)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron distributed checkpoint")
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: the HF weights' own)")
    _layout_args(p)
    p = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF directory (safetensors, config, tokenizer)")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="HF directory to create")
    p.add_argument("--hf-ref", default=None,
                   help="HF model directory whose config and tokenizer to use instead of the checkpoint's "
                   "(needed for checkpoints that record none)")
    p.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="largest safetensors file (default 5GB)")
    _base_arg(p)
    _layout_args(p)
    p = sub.add_parser("mcore-to-peft", help="LoRA checkpoint -> PEFT adapter directory (adapter_model.safetensors, "
                       "adapter_config.json)")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint directory of a LoRA run")
    p.add_argument("--out", required=True, help="adapter directory to create")
    p.add_argument("--hf-ref", default=None,
                   help="HF model directory whose config to use instead of the checkpoint's (needed for checkpoints "
                   "that record none)")
    p.add_argument("--base-model", default=None,
                   help="the base model's name or path, recorded as the adapter's base_model_name_or_path")
    _base_arg(p)
    _layout_args(p)
    p = sub.add_parser("reshard", help="rewrite a Megatron checkpoint under another TP/PP/EP layout")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--hf-ref", default=None,
                   help="HF model directory whose config and tokenizer to carry instead of the checkpoint's")
    _base_arg(p)
    _layout_args(p)
    p = sub.add_parser("quantize", help="HF directory or Megatron checkpoint -> FP8 or NVFP4 checkpoint that vLLM "
                       "and SGLang load (nvidia-modelopt)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="HF model directory")
    source.add_argument("--mcore", help="megatron-alp checkpoint (e.g. RUN/checkpoints/iter_N)")
    p.add_argument("--out", required=True, help="HF directory to create")
    p.add_argument("--format", choices=["fp8", "nvfp4"], default="fp8", help="quantized format (default fp8)")
    p.add_argument("--calib", required=True, help="data file in the training format (.jsonl or .parquet) whose "
                   "prompts and answers calibrate the activation scales")
    p.add_argument("--calib-samples", type=int, default=128, help="rows of --calib to calibrate on (default 128)")
    p.add_argument("--calib-length", type=int, default=1024, help="tokens per calibration sample at most (default 1024)")
    _base_arg(p)
    p.set_defaults(tp=1, pp=1, ep=1, layer_spec="auto")
    p = sub.add_parser("verify", help="compare HF and Megatron logits on a fixed batch")
    p.add_argument("--hf", required=True, help="HF model directory")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint directory")
    p.add_argument("--tol", type=float, default=1e-4, help="largest accepted max |logit diff| (default 1e-4, fp32)")
    _base_arg(p)
    _layout_args(p)


def _hf_config_of(args) -> dict:
    if args.action == "hf-to-mcore" or (args.action == "quantize" and args.hf):
        from megatron_alp.models.hf_weights import open_hf_checkpoint

        return open_hf_checkpoint(args.hf)[0]
    if args.action == "verify":
        from megatron_alp.models.families import load_hf_config
        from megatron_alp.training.dist_checkpoint import read_metadata

        read_metadata(args.mcore)
        return load_hf_config(args.hf)
    from megatron_alp.training.export import hf_source

    return hf_source(args.mcore, getattr(args, "hf_ref", None),
                     need_tokenizer=args.action in ("mcore-to-hf", "quantize"))[0]


def check_quantize(args) -> None:
    """What ``quantize`` needs beyond a model: modelopt, and calibration rows."""
    import importlib.util

    from megatron_alp.data.prompts import prompt_rows

    if importlib.util.find_spec("modelopt") is None:
        raise ValueError("convert quantize needs nvidia-modelopt: pip install nvidia-modelopt")
    for key in ("calib_samples", "calib_length"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(args, key)})")
    prompt_rows(args.calib)


def check_base(args) -> None:
    """A LoRA checkpoint without base weights: its base folder (``--base``, else the recorded one)
    holds the weights it was trained on. ``--base`` for anything else is refused, not ignored."""
    from megatron_alp.training.dist_checkpoint import read_metadata
    from megatron_alp.training.lora_base import verified_base

    base = getattr(args, "base", None)
    recorded = read_metadata(args.mcore).get("lora_base") if getattr(args, "mcore", None) else None
    if recorded:
        verified_base(args.mcore, recorded, base, hint="; pass --base DIR naming a folder that holds it")
    elif base is not None:
        raise ValueError(f"--base {base}: {args.mcore or args.hf} holds its own weights (--base is for a LoRA "
                         "checkpoint saved without its base)")


def check(args):
    """Validate the inputs and layout without starting any rank; returns the ParallelConfig."""
    from megatron_alp.models.families import hf_to_megatron

    for key in ("tp", "pp", "ep"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key} must be >= 1 (got {getattr(args, key)})")
    out = getattr(args, "out", None)
    if out is not None and Path(out).exists():
        raise FileExistsError(f"--out {out} already exists; choose a new directory")
    margs = hf_to_megatron(_hf_config_of(args))
    check_base(args)
    if args.action == "quantize":
        check_quantize(args)
    if args.action == "mcore-to-peft":
        from megatron_alp.training.export import adapter_lora

        adapter_lora(args.mcore)
    from megatron_alp.training.builder import check_parallel_layout  # imports Megatron: after the cheap checks

    parallel = checkpoint_tools.parallel_config(args.tp, args.pp, args.ep, moe="num_moe_experts" in margs.transformer)
    check_parallel_layout(margs, parallel)
    return parallel


def _execute(args, parallel) -> None:
    if args.action == "hf-to-mcore":
        from checkpoint_tools.hf_to_mcore import convert

        convert(args.hf, args.out, parallel, layer_spec=args.layer_spec, dtype=args.dtype)
    elif args.action == "mcore-to-hf":
        from checkpoint_tools.mcore_to_hf import convert

        convert(args.mcore, args.out, parallel, hf_ref=args.hf_ref, layer_spec=args.layer_spec,
                max_shard_bytes=args.max_shard_size, base_dir=args.base)
    elif args.action == "mcore-to-peft":
        from checkpoint_tools.mcore_to_peft import convert

        convert(args.mcore, args.out, parallel, hf_ref=args.hf_ref, layer_spec=args.layer_spec,
                base_model=args.base_model, base_dir=args.base)
    elif args.action == "reshard":
        from checkpoint_tools.reshard import reshard

        reshard(args.mcore, args.out, parallel, hf_ref=args.hf_ref, layer_spec=args.layer_spec, base_dir=args.base)
    elif args.action == "quantize":
        from checkpoint_tools.quantize import quantize

        quantize(args.mcore or args.hf, args.out, args.format, args.calib, samples=args.calib_samples,
                 max_length=args.calib_length, megatron=bool(args.mcore), log=say, base_dir=args.base)
    else:
        from checkpoint_tools.verify import verify

        verify(args.hf, args.mcore, parallel, layer_spec=args.layer_spec, tol=args.tol, base_dir=args.base)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def log_path(args) -> Path:
    """Where the action's library output goes: beside what it writes (or checks)."""
    target = Path(args.out if getattr(args, "out", None) else args.mcore).absolute()
    return target.with_name(f"{target.name}.{'verify' if args.action == 'verify' else 'convert'}.log")


def _launch(args, nproc: int) -> int:
    """Run this action on ``nproc`` local ranks through torchrun; clean up after a failure."""
    root = str(Path(checkpoint_tools.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "checkpoint_tools.cli", "--job", json.dumps(vars(args))]
    rc = subprocess.call(cmd, env=env)
    out = getattr(args, "out", None)
    if rc != 0 and out is not None:
        out = Path(out).absolute()
        for tmp in out.parent.glob(out.name + ".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        say_error(f"megatron-alp convert {args.action}: failed on one of {nproc} ranks (see {log_path(args)}); "
                  f"nothing was written to {out}")
    return rc


def _fail(args, err: BaseException) -> int:
    rank = os.environ.get("RANK")
    where = f" (rank {rank})" if rank is not None else ""
    msg = err.args[0] if isinstance(err, KeyError) and err.args else err
    say_error(f"megatron-alp convert {args.action}: error{where}: {msg}")
    return 2


def _run_here(args, parallel) -> int:
    """The action on this rank, its library output in the log; rank 0 says what it wrote."""
    from megatron_alp.runtime.parallel import destroy_distributed

    with library_output_to(log_path(args)):
        try:
            _execute(args, parallel)
        except BAD_INPUT as err:
            return _fail(args, err)
        finally:
            destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0 and getattr(args, "out", None):
        files = [f for f in Path(args.out).rglob("*") if f.is_file()]
        say(f"megatron-alp convert {args.action}: wrote {args.out} ({len(files)} files, "
            f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB); library output in {log_path(args)}")
    return 0


def run(args) -> int:
    try:
        with held_warnings():  # the libraries' import-time warnings belong in the log
            parallel = check(args)
    except BAD_INPUT as err:
        return _fail(args, err)
    nproc = checkpoint_tools.world_size(args.tp, args.pp, args.ep)
    if nproc > 1 and not _under_torchrun():
        return _launch(args, nproc)
    return _run_here(args, parallel)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:  # a rank started by _launch
        args = argparse.Namespace(**json.loads(argv[1]))
        try:
            with held_warnings():
                parallel = check_for_worker(args)
        except BAD_INPUT as err:
            return _fail(args, err)
        return _run_here(args, parallel)
    parser = argparse.ArgumentParser(prog="megatron-alp convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def check_for_worker(args):
    """The layout of a launched rank (inputs were checked by the launcher; ``--out`` may now be
    created by a peer, so only the layout is rebuilt)."""
    from megatron_alp.models.families import hf_to_megatron

    margs = hf_to_megatron(_hf_config_of(args))
    return checkpoint_tools.parallel_config(args.tp, args.pp, args.ep, moe="num_moe_experts" in margs.transformer)


if __name__ == "__main__":
    sys.exit(main())
