"""A quantized checkpoint for serving, written by nvidia-modelopt: ``megatron-alp convert quantize``.

modelopt inserts its quantizers into the Hugging Face model, calibrates their scales on the prompts
of a training-format data file (the activations' ranges come from that data, so use prompts like
the ones the model will serve), and exports a Hugging Face folder whose ``config.json`` says
``quant_method: modelopt``: FP8 (per-tensor e4m3 weights and static input scales) or NVFP4 (e2m1
weights in blocks of 16 with e4m3 block scales). vLLM and SGLang load that folder as it is. The
embedding and the output layer stay in the model's precision, as modelopt leaves them.

A megatron-alp checkpoint is exported to Hugging Face first (:mod:`megatron_alp.training.export`).
Calibration runs on a GPU when there is one; on the CPU modelopt's fake quantization does the same
arithmetic, slowly, which is enough for small models and for the tests. Serving the result needs
the GPU kernels of the engine (FP8: Hopper or Ada; NVFP4: Blackwell).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from megatron_alp.config import ParallelConfig
from megatron_alp.data.prompts import encode_messages, load_tokenizer, prompt_rows
from megatron_alp.models.hf_weights import copy_hf_side_files
from megatron_alp.training.export import export_hf

# format -> the modelopt recipe (a name in modelopt.torch.quantization)
FORMATS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}


def calibration_batches(hf_dir: str | Path, calib_file: str | Path, samples: int, max_length: int) -> list[torch.Tensor]:
    """Token ids (one ``[1, T]`` tensor per sample) of the first ``samples`` rows of ``calib_file``:
    each prompt in the model's chat template followed by its reference answer, at most ``max_length``
    tokens."""
    tokenizer = load_tokenizer(hf_dir)
    rows = prompt_rows(calib_file)[:samples]
    batches = []
    for _, messages, answer in rows:
        ids = encode_messages(tokenizer, messages) + list(tokenizer.encode(answer, add_special_tokens=False))
        batches.append(torch.tensor([ids[:max_length]], dtype=torch.long))
    return batches


def quantize_hf(hf_dir: str | Path, out: str | Path, fmt: str, batches: list[torch.Tensor],
                log: Callable[[str], None] = print) -> None:
    """Calibrate ``hf_dir`` in format ``fmt`` on ``batches`` and write the quantized folder to ``out``
    (complete or not at all: it is written beside and renamed)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {sorted(FORMATS)}")
    out = Path(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()

    def forward_loop(m):
        for i, ids in enumerate(batches):
            m(input_ids=ids.to(device))
            if (i + 1) % 32 == 0:
                log(f"calibrated on {i + 1} of {len(batches)} samples")

    with torch.no_grad():
        mtq.quantize(model, getattr(mtq, FORMATS[fmt]), forward_loop)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        copy_hf_side_files(hf_dir, tmp)  # the tokenizer; modelopt writes the config and the weights
        export_hf_checkpoint(model, export_dir=str(tmp))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def quantize(source: str | Path, out: str | Path, fmt: str, calib_file: str | Path, *, samples: int,
             max_length: int, megatron: bool, log: Callable[[str], None] = print, base_dir=None) -> None:
    """``source`` (a Hugging Face folder, or a megatron-alp checkpoint when ``megatron``) quantized
    to ``out``; ``base_dir``: a LoRA checkpoint's base folder, if not the recorded one."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=out.name + ".export-", dir=out.parent) as scratch:
        hf_dir = Path(source)
        if megatron:
            hf_dir = Path(scratch) / "hf"
            log(f"exporting {source} to Hugging Face safetensors for calibration")
            export_hf(source, hf_dir, ParallelConfig(), base_dir=base_dir)
        batches = calibration_batches(hf_dir, calib_file, samples, max_length)
        if not batches:
            raise ValueError(f"--calib {calib_file}: no usable rows to calibrate on")
        quantize_hf(hf_dir, out, fmt, batches, log)
