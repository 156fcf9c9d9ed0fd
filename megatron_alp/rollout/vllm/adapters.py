"""The LoRA adapter a vLLM rollout engine generates with (``lora.sync: adapter``).

Started with ``lora_rank``, the engine loads the base weights once with vLLM's LoRA support on (one
adapter slot). Each new adapter is written as a PEFT folder (``adapter_model.safetensors`` +
``adapter_config.json``) in the sync folder, registered under a new id, and the previous one is
dropped; every request then carries it. The folder outlives the engine: a restarted engine
registers it again (:class:`~megatron_alp.rollout.vllm.process.EngineProcess`), so a restart
loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.base import RolloutError
from megatron_alp.rollout.weight_sync import default_sync_root


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (it allows only a few values) that holds ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank}: vLLM applies adapters of rank up to {allowed[-1]}; use a lower "
                         "lora.rank, or lora.sync: merged")
    return fits[0]


def write_adapter_folder(tensors: dict[str, torch.Tensor], config: dict, folder: Path) -> Path:
    """``folder`` as PEFT's ``save_pretrained`` writes it (``adapter_model.safetensors``,
    ``adapter_config.json``), which vLLM loads adapters from. Written next to it and renamed, so
    ``folder`` appears complete or not at all."""
    from safetensors.torch import save_file

    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(tensors, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


class Adapters:
    """One engine's adapter slot: the LoRA rank it was started for (:attr:`rank`, None: LoRA off), the
    adapter every request carries (:attr:`current`, vLLM's ``LoRARequest``) and the folder its PEFT
    folders are written in (:attr:`root`)."""

    def __init__(self, cfg: RolloutConfig, rank: Optional[int]):
        self.cfg = cfg
        self.rank = rank
        if rank is not None:
            max_lora_rank(rank)  # refused before the engine starts
        self.current = None
        self.root: Optional[Path] = None

    def take(self, stream, config: dict | Callable[[list[str]], dict]) -> tuple[dict[str, torch.Tensor], dict]:
        """The adapter's tensors, copied to the CPU, and its config (``config`` may be a function of
        the tensor names, for a stream whose names are known only at its end), once checked against
        the rank the engine takes."""
        if self.rank is None:
            raise RolloutError("update_adapter: this vLLM engine was started without LoRA (lora_rank); "
                               "lora.sync: adapter needs VLLMEngine(..., lora_rank=lora.rank)")
        # copies: the trainer's tensors may be views of one buffer (q/k/v share lora_A), which safetensors refuses
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in stream}
        config = config(list(state)) if callable(config) else config
        rank = int(config.get("r", 0))
        if not 0 < rank <= self.rank:
            raise RolloutError(f"update_adapter: adapter rank r={config.get('r')!r}, but the engine takes ranks "
                               f"1 to {self.rank} (lora.rank)")
        return state, config

    def install(self, llm, state: dict[str, torch.Tensor], config: dict) -> None:
        """Register the adapter (``state``, emptied once written) with ``llm`` under a new id and make
        it :attr:`current`; the previous one is removed from the engine and its folder deleted, so one
        adapter is held at a time."""
        from vllm.lora.request import LoRARequest

        if self.root is None:
            self.root = default_sync_root(self.cfg.sync_dir)
        number = self.current.lora_int_id + 1 if self.current is not None else 1
        folder = write_adapter_folder(state, config, self.root / f"adapter-{number:06d}")
        state.clear()  # the copies are on disk now: freed before vLLM loads the folder
        # the name keys vLLM's prefix cache: a new one per adapter, so no block computed under the old
        # adapter is reused
        request = LoRARequest(lora_name=f"adapter-{number}", lora_int_id=number, lora_path=str(folder))
        try:
            llm.llm_engine.add_lora(request)
        except Exception as err:  # vLLM loads the new adapter whole before evicting the current one, still in use
            shutil.rmtree(folder, ignore_errors=True)
            raise RolloutError(f"vLLM rejected the LoRA adapter (lora.sync: adapter): {type(err).__name__}: {err}"
                               ) from err
        old, self.current = self.current, request
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """The engine shuts down for good: delete the adapters' folder."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = self.current = None
