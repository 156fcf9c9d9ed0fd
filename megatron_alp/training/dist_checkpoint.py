"""Megatron distributed checkpoints (``torch_dist``), written atomically.

A checkpoint directory holds Megatron's ``dist_checkpointing`` files (layout-independent: model
and optimizer state load under any DP/TP/PP/EP layout, the optimizer in the format it was saved
with), ``extra.pt`` (trainer state such as the data position), ``hf/`` with
the tokenizer and generation files of the HF model it came from, and ``megatron_alp.json``: the
format, the layout it was written with, the HF config (its only copy) and the ALP perturbation
settings, so the export to HF needs nothing but the checkpoint. Every file is written into
``<dir>.tmp-XXXX`` and the folder is renamed only when all ranks are done, so a crash mid-save
never leaves a folder that looks complete; :func:`latest_checkpoint` only considers folders with
the metadata file. Before the rename every file's size and digest go into ``checksums.json``
(:mod:`megatron_alp.training.checksums`), and a resume takes the newest checkpoint that still
matches them (:func:`intact_checkpoint`). A save that runs out of disk space removes what it wrote,
keeps the previous checkpoint and says how much space the checkpoint needs (:class:`DiskFullError`).

The distributed optimizer's state is saved in Megatron's ``fully_reshardable`` form (loads at any
layout) with ``distrib_optim_fully_reshardable_mem_efficient``: gathered over gloo onto each data-parallel
group's first rank, in host memory, never on the GPU; :func:`save_transient` counts what that costs, for
the save and for ``megatron-alp plan``. A load reads on each rank only the state of the parameters
its optimizer shard holds (:func:`_optimizer_state_io`).

ALP sigmas are saved under one key per global layer (``decoder.layers.{i}.alp_perturbation
.log_sigma``), not in Megatron's layer-stacked form, because only the selected layers have one: a
stacked tensor with holes cannot be written, and per-layer keys make sigma i land on layer i
under any pipeline split.

LoRA adapters are saved sharded like their layers
(:meth:`~megatron_alp.models.lora.LoRAAdapter.sharded_state_dict`), so they reshard like them; the
metadata's ``lora`` (their config, null without adapters) says whether a checkpoint has them, and
``load_checkpoint(..., base_only=True)`` starts a LoRA model from a checkpoint without them. A LoRA
run's checkpoint (``save_checkpoint(..., lora_base=...)``) holds no base weights: only the adapters,
sigmas and optimizer state, with the base's Hugging Face folder and fingerprint in the metadata's
``lora_base`` (:mod:`megatron_alp.training.lora_base`); a load reads the base from that folder (or
``base_dir``), refusing one whose weights changed. Checkpoints that hold the base weights (``lora_base``
null or absent: earlier LoRA checkpoints, converted ones) load as before.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

from megatron_alp.config import InputError
from megatron_alp.models.families import load_hf_config
from megatron_alp.models.hf_weights import (
    check_model_matches,
    copy_hf_side_files,
    global_name,
    load_hf_weights,
    make_tmp_dir,
)
from megatron_alp.models.lora import adapters, lora_metadata
from megatron_alp.models.weight_mapping import is_adapter, is_sigma
from megatron_alp.training.checksums import damage, write_manifest
from megatron_alp.training.lora_base import LoRABase, verified_base
from megatron_alp.training.perturbation import controller_of

META_FILE = "megatron_alp.json"
EXTRA_FILE = "extra.pt"
HF_SUBDIR = "hf"
FORMAT = "megatron-alp/dist-checkpoint/1"
# The distributed optimizer's state in a layout-independent form (reshardable over TP/PP/DP/EP), gathered
# for the save over gloo onto each data-parallel group's first rank in host memory (see save_transient).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}
ADAM_STATES = ("param", "exp_avg", "exp_avg_sq")  # fp32 main parameter, Adam m and v: what the gather moves


@dataclasses.dataclass(frozen=True)
class SaveTransient:
    """What a checkpoint save allocates beyond the resident state, on a data-parallel group's first rank."""

    gpu: int  # bytes on the GPU
    host: int  # bytes of host memory
    basis: str  # how the GPU bytes were counted


def save_transient(buffers: list[tuple[int, int]], staged: int, metadata: Optional[dict] = None) -> SaveTransient:
    """The save's transient memory under ``metadata`` (default: :data:`OPTIMIZER_METADATA`, read at the
    call, as :func:`save_checkpoint` reads it). ``buffers``: (parameters, data-parallel size) of each
    gradient buffer of this rank's distributed optimizer (dense and expert; one bucket each, as
    ``overlap_grad_reduce`` is off); ``staged``: bytes of GPU tensors this rank writes (its weights, a
    plain optimizer's state), which the writer copies to host memory all at once.

    Megatron-Core 0.16.1's ``fully_reshardable`` save (``DistributedOptimizer.get_parameter_state_dp_zero``)
    gathers the three fp32 states of each buffer in turn, state by state, into host tensors of the whole
    buffer that stay until the save is written (12 B per parameter). While a buffer is gathered, the
    rank's own shards (12/DP B per parameter) and the received shards, their concatenation and the
    previous state's (12 B per parameter) are alive too; the writer copies the staged tensors after the
    gathers. With ``distrib_optim_fully_reshardable_mem_efficient`` the gather runs over gloo into the
    group's first rank alone (the others hold only their shards); without it NCCL all-gathers onto every
    rank's GPU as well: the rank's shard and the DP received ones, (1 + 1/DP) x 4 B per parameter of
    the buffer, one state at a time."""
    metadata = OPTIMIZER_METADATA if metadata is None else metadata
    if metadata.get("distrib_optim_sharding_type") != "fully_reshardable":
        raise ValueError(f"no transient known for the optimizer format {metadata}")
    if not buffers:
        return SaveTransient(0, staged, "no distributed optimizer: nothing gathered")
    state_bytes = 4 * len(ADAM_STATES)
    world = sum(state_bytes * params for params, _ in buffers)
    gather = max(state_bytes * params + state_bytes * params // dp for params, dp in buffers)
    host = world + max(gather, staged)
    if metadata.get("distrib_optim_fully_reshardable_mem_efficient"):
        return SaveTransient(0, host, "optimizer state gathered over gloo on the host: none on the GPU")
    gpu, params, dp = max((4 * params + 4 * params // dp, params, dp) for params, dp in buffers)
    return SaveTransient(gpu, host, f"NCCL all-gather of one fp32 state: {params / 1e9:.2f}B x 4 B x (1 + 1/DP{dp})")


def _is_base_weight(key: str) -> bool:
    """A frozen base weight of a LoRA model: not an adapter, a sigma or Megatron's ``_extra_state``."""
    return not (is_adapter(key) or is_sigma(key) or key.endswith("_extra_state"))


def model_sharded_state_dict(model) -> dict:
    """``model.sharded_state_dict()`` with ALP sigmas under per-global-layer keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model = unwrap_model(model)
    sd = model.sharded_state_dict()
    for key, value in list(sd.items()):
        if is_sigma(key) and isinstance(value, ShardedTensor):
            sd[key] = ShardedTensor.from_rank_offsets(
                global_name(key, model), value.data, replica_id=value.replica_id
            )
    return sd


def _in_process_write_queue() -> None:
    """Megatron's ``torch_dist`` writer reports results through a queue that it creates, on first
    use, in a *spawned* multiprocessing Manager: meant for asynchronous saves, it re-imports the
    caller's ``__main__`` (hanging scripts without a main guard) and costs a process start. Saves
    here are synchronous, so the writer runs in this process and a plain queue serves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def check_optimizer_groups(optimizer) -> None:
    """Megatron matches checkpointed optimizer param groups to the live ones by the identifier
    (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); two groups sharing one would be
    restored with each other's hyperparameters, so refuse them up front."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        seen: dict = {}
        for i, group in enumerate(sub.param_groups):
            key = tuple(group.get(k) for k in param_group_identifier_keys)
            if key in seen:
                raise ValueError(
                    f"optimizer param groups {seen[key]} and {i} share Megatron's group identifier "
                    f"{dict(zip(param_group_identifier_keys, key))}; a checkpoint cannot tell them apart "
                    "(give one of them a distinct value, e.g. `is_decoupled_lr`)"
                )
            seen[key] = i


def _prepare_optimizer_for_load(optimizer) -> None:
    """Building the checkpoint state dict of Megatron-Core 0.16's DistributedOptimizer reads
    ``step`` from every parameter's state when neither Apex nor TE is installed (torch's AdamW
    keeps a per-parameter ``step``, their fused Adams do not); an optimizer that has not stepped
    yet lacks it, so give it zero state (the load overwrites it). The loading side of the same gap
    is a shim in :mod:`megatron_alp.runtime.platform`; the restored ``step`` is shared by all parameters,
    see :func:`_unshare_optimizer_steps`."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, distrib_optimizer.DistributedOptimizer) and not sub.optimizer.state and sub.init_state_fn:
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))


def _distributed_subs(optimizer) -> list:
    return [sub for sub in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(sub, DistributedOptimizer)]


def _pads_between_buckets() -> bool:
    """Whether the installed Megatron-Core saves state shifted once a buffer has several buckets
    (:func:`_optimizer_state_io`)."""
    return "missing_elems_num" in inspect.getsource(DistributedOptimizer.sharded_param_state_fully_reshardable)


@contextlib.contextmanager
def _optimizer_state_io(optimizer, loading: bool):
    """Megatron's ``fully_reshardable`` state dict of the distributed optimizer, with two changes.

    Saving: Megatron-Core 0.16 saves wrong state once a gradient buffer has more than one bucket (a
    long model, or the tied embedding on the last pipeline stage): it packs each bucket's state
    without the padding between buckets, then slices it with offsets that count that padding, so
    every parameter after the first bucket is saved shifted, its tail zero-filled ("param range
    exceeds unpadded buffer", Megatron-LM #5077). The packed state is put back at the buffer's own
    offsets (installed versions without the bug are left alone).

    The ranks the gather leaves without state (not their group's first) return nothing instead of a
    None that Megatron would compare with rank 0's common state and warn about.

    Loading: Megatron has every rank allocate zeroed host tensors of its whole model-parallel slice
    and read every parameter's state into them, then keeps only the range of its own optimizer shard
    (``load_parameter_state_from_fully_reshardable`` skips the other parameters). Here those tensors
    are allocated empty (host pages are committed only where the load writes), and the parameters
    this rank keeps nothing of are left out of the load, so each rank reads about 1/DP of the slice."""
    patched = []
    for sub in _distributed_subs(optimizer):
        patches = {"sharded_param_state_fully_reshardable": _loaded_params_state if loading else _saved_params_state}
        if loading:
            patches["get_parameter_state_dp_zero"] = _empty_world_state
        elif _pads_between_buckets():
            patches["get_parameter_state_dp_zero"] = _state_at_buffer_offsets
        for name, fn in patches.items():
            setattr(sub, name, functools.partial(fn, sub))
        patched.append((sub, patches))
    try:
        yield
    finally:
        for sub, patches in patched:
            for name in patches:
                delattr(sub, name)


def _state_at_buffer_offsets(sub, **kwargs) -> Optional[dict]:
    """``sub``'s packed DP-rank-0 state with each bucket's values at the bucket's buffer offset."""
    state = type(sub).get_parameter_state_dp_zero(sub, **kwargs)
    if state is None:
        return None
    for gbuf_idx, by_dtype in state.items():
        if not isinstance(gbuf_idx, int):
            continue
        buffer = sub.buffers[gbuf_idx]
        for world in by_dtype.values():
            for key in ADAM_STATES if world else ():
                packed, spread, at = world[key], torch.zeros(buffer.numel, dtype=world[key].dtype), 0
                for bucket in buffer.buckets:
                    spread[bucket.offset:bucket.offset + bucket.numel_unpadded] = packed[at:at + bucket.numel_unpadded]
                    at += bucket.numel_unpadded
                world[key] = spread
    return state


def _empty_world_state(sub, **kwargs) -> dict:
    """What ``get_parameter_state_dp_zero(empty_data=True)`` returns for a load, at the buffers' own
    offsets and uninitialised: its values are never read, only overwritten by the load."""
    assert kwargs.get("empty_data"), kwargs
    state = {"buckets_coalesced": True}
    for gbuf_idx, by_dtype in enumerate(sub.gbuf_ranges):
        buffer = sub.buffers[gbuf_idx]
        state[gbuf_idx] = {dtype: {**{key: torch.empty(buffer.numel, dtype=torch.float32) for key in ADAM_STATES},
                                   "numel_unpadded": buffer.numel_unpadded} for dtype in by_dtype}
    return state


def _saved_params_state(sub, *args):
    """Megatron's ``fully_reshardable`` parameter state for a save, nothing on the ranks without it."""
    state = type(sub).sharded_param_state_fully_reshardable(sub, *args)
    return LocalNonpersistentObject(None) if state is None else state


def _loaded_params_state(sub, *args):
    """Megatron's ``fully_reshardable`` parameter state for a load, without the parameters of which
    this rank's optimizer shard holds nothing. The entries keep Megatron's numbers (every parameter of
    every buffer, in the buffer's order). Megatron checks that exactly one main replica reads each
    piece of every tensor; a parameter is a replica of the model's over data parallelism, so the main
    one becomes the rank whose shard holds the parameter's start."""
    state = type(sub).sharded_param_state_fully_reshardable(sub, *args)
    main, index = {}, 0  # entry number -> whether this rank reads it as the main replica
    for gbuf_idx, by_dtype in enumerate(sub.gbuf_ranges):
        for by_bucket in by_dtype.values():
            owned = collections.ChainMap(*(bucket["param_map"] for bucket in by_bucket))
            for param in sub.buffers[gbuf_idx].param_index_map:
                if param in owned:
                    main[index] = owned[param]["param"].start == 0
                index += 1
    return {i: {key: dataclasses.replace(tensor, replica_id=(*tensor.replica_id[:-1], 0 if main[i] else 1))
                for key, tensor in tensors.items()}
            for i, tensors in state.items() if i in main}


def _unshare_optimizer_steps(optimizer) -> None:
    """Give every parameter its own ``step`` tensor after a load (see above)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shared_tmp_dir(final: Path) -> Path:
    """A fresh ``<final>.tmp-XXXX`` created by rank 0, its name shared with every rank."""
    name = [None]
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        name[0] = make_tmp_dir(final)
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def commit_dir(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp`` (a previous ``final`` is moved aside first, then deleted)."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=final.name + ".old-", dir=final.parent))
        os.replace(final, old / final.name)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def current_layout(optimizer=None) -> dict:
    """This job's parallel layout, as the checkpoint metadata records it (``optimizer``: which
    optimizer state format the job uses, ``distributed`` or ``plain``, and how many optimizers it chains)."""
    layout = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    if optimizer is not None:
        layout["optimizer"] = _optimizer_format(optimizer)
        layout["optimizers"] = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    return layout


def _optimizer_format(optimizer) -> str:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return "distributed" if any(isinstance(sub, DistributedOptimizer) for sub in subs) else "plain"


def _check_optimizer_format(ckpt: Path, saved: dict, optimizer) -> None:
    """Refuse optimizer state that cannot load into this job's optimizer: Megatron's two formats do
    not load into each other (the distributed optimizer's keeps fp32 main parameters), and an MoE
    model's experts share the dense optimizer at EP=1 but get their own at EP>1, which changes the
    state's structure."""
    was, now = saved.get("optimizer"), _optimizer_format(optimizer)
    if was is not None and was != now:
        raise InputError(
            f"{ckpt}: its optimizer state was saved by the {was} optimizer and this job builds the {now} one; "
            f"set parallel.use_distributed_optimizer={str(was == 'distributed').lower()} to resume it")
    chain = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved.get("optimizers", chain) != chain:
        ep = saved.get("expert_model_parallel_size")
        raise InputError(
            f"{ckpt}: saved at parallel.expert_model_parallel_size={ep}, where the experts' optimizer state is "
            f"{'part of the dense optimizer' if ep == 1 else 'an optimizer of its own'}; this job's "
            f"expert_model_parallel_size={ps.get_expert_model_parallel_world_size()} cannot hold it: resume with "
            f"{'parallel.expert_model_parallel_size=1' if ep == 1 else 'parallel.expert_model_parallel_size > 1'}")


# Each layout size a resume may change: its short name and what its change makes inexact, if
# anything (see :func:`relayout_line`).
_RELAYOUT = {
    "data_parallel_size": ("DP", "mini-batches split over another number of ranks (float sums in another order)"),
    "tensor_model_parallel_size": ("TP", "weights split over another number of ranks (float sums in another order)"),
    "pipeline_model_parallel_size": ("PP", None),
    "expert_model_parallel_size": ("EP", "expert gradients reduced over another number of ranks (float sums in "
                                         "another order)"),
}


def relayout_line(ckpt: Path, saved: dict, now: dict, perturbed: bool) -> Optional[str]:
    """One line for a resume at another layout than the checkpoint's: what carries over exactly and
    what cannot (None when the layout is the same). ALP noise is drawn per (data-parallel rank,
    pipeline rank[, TP rank under sequence parallelism]) stream, so a new layout draws other noise
    from here on: same distribution, other samples."""
    changed = [k for k in _RELAYOUT if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    sizes = ", ".join(f"{_RELAYOUT[k][0]} {saved[k]} -> {now[k]}" for k in changed)
    inexact = [note for k in changed if (note := _RELAYOUT[k][1])]
    if perturbed:
        inexact.append("ALP noise from other per-rank streams (same sigmas and distribution, other samples)")
    rest = f"not exactly: {'; '.join(inexact)}" if inexact else "nothing else changes"
    return (f"resuming {ckpt.name} at another layout ({sizes}): weights, optimizer state, ALP sigmas, the LR "
            f"schedule, the data position and the rollout seeds carry over exactly; {rest}")


def _perturbation(model) -> Optional[dict]:
    c = controller_of(model)
    return None if c is None else c.cfg.model_dump()


def save_checkpoint(
    ckpt_dir,
    model,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    extra: dict | None = None,
    hf_config: dict | None = None,
    hf_dir=None,
    lora_base: LoRABase | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> None:
    """Save ``model`` (and optionally the Megatron optimizer and LR scheduler) to ``ckpt_dir``.

    Collective over all ranks. ``extra`` (rank 0's copy) comes back from :func:`load_checkpoint`.
    ``hf_dir``: the HF model directory the model was built from; its tokenizer and generation
    files go to ``hf/`` and its ``config.json`` into the metadata (``hf_config`` given instead
    takes precedence), so the checkpoint exports to a loadable HF directory on its own.
    ``lora_base``: the record of the HF folder a LoRA model's frozen base was read from
    (:class:`LoRABase`); the checkpoint then holds the adapters, sigmas and optimizer state without
    the base weights, and keeps the record for the load.
    ``before_commit(tmp_dir)`` runs on every rank once all files are written, before the rename
    (for adding files, or for fault-injection tests). An existing ``ckpt_dir`` is replaced.
    """
    from megatron.core import dist_checkpointing

    model = unwrap_model(model)
    if hf_config is None and hf_dir is not None:
        hf_config = load_hf_config(hf_dir)  # on every rank: a bad hf_dir fails them all, before any collective
    if lora_base is not None and not adapters(model):
        raise ValueError(f"{ckpt_dir}: lora_base given for a model without LoRA adapters (its weights are all "
                         "trained: they go into the checkpoint)")
    final = Path(ckpt_dir).absolute()
    tmp = _shared_tmp_dir(final)
    try:
        state = {"model": model_sharded_state_dict(model)}
        if lora_base is not None:
            state["model"] = {k: v for k, v in state["model"].items() if not _is_base_weight(k)}
        if optimizer is not None:
            check_optimizer_groups(optimizer)
            with _optimizer_state_io(optimizer, loading=False):
                state["optimizer"] = optimizer.sharded_state_dict(
                    state["model"], is_loading=False, metadata=OPTIMIZER_METADATA)
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        _in_process_write_queue()
        dist_checkpointing.save(state, str(tmp))
        if _rank() == 0:
            torch.save(extra or {}, tmp / EXTRA_FILE)
            if hf_dir is not None:
                copy_hf_side_files(hf_dir, tmp / HF_SUBDIR)
            write_json_atomic(tmp / META_FILE, _metadata(model, optimizer, opt_param_scheduler, extra, hf_config,
                                                         lora_base))
        _barrier()
        write_manifest(tmp)
        _barrier()
        if before_commit is not None:
            before_commit(tmp)
        _barrier()
        if _rank() == 0:
            commit_dir(tmp, final)
        _barrier()
    except BaseException as err:
        written = _tree_bytes(tmp) if _disk_full(err) else 0
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):
            raise DiskFullError(final, written) from err
        raise


def _metadata(model, optimizer, opt_param_scheduler, extra: dict | None, hf_config: dict | None,
              lora_base: LoRABase | None) -> dict:
    """What ``META_FILE`` says of a checkpoint: read without loading a tensor (layout, dtype, HF config,
    ALP sites, LoRA and its base, what state it holds, the plain values of ``extra``)."""
    return {
        "format": FORMAT,
        "saved_at": time.time(),
        "layout": current_layout(optimizer),
        "dtype": str(model.config.params_dtype).removeprefix("torch."),
        "hf_config": hf_config,
        "perturbation": _perturbation(model),
        "lora": lora_metadata(model),
        "lora_base": None if lora_base is None else dataclasses.asdict(lora_base),
        "has_optimizer": optimizer is not None,
        "has_scheduler": opt_param_scheduler is not None,
        "extra": {k: v for k, v in (extra or {}).items() if _plain(v)},
    }


def _plain(value) -> bool:
    """A number, string or flag, or a list of them: what the metadata shows of ``extra``."""
    if isinstance(value, list):
        return all(_plain(v) and not isinstance(v, list) for v in value)
    return isinstance(value, (int, float, str, bool))


class DiskFullError(OSError):
    """A checkpoint save ran out of disk space; what it wrote is removed, the previous checkpoints stay."""

    def __init__(self, final: Path, written: int):
        free = shutil.disk_usage(final.parent).free
        previous = next((_tree_bytes(d) for d in checkpoints_newest_first(final.parent.parent)), 0)
        need = (f"about {_size(previous)} (the size of the last complete one)" if previous else
                f"more than the {_size(written)} written before the disk filled")
        super().__init__(
            errno.ENOSPC,
            f"checkpoint {final}: the disk is full ({_size(free)} free on {final.parent} after removing the "
            f"partial save); a checkpoint of this run needs {need}; the previous checkpoints are kept: free "
            "space or lower trainer.keep_checkpoints, then resume")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` or an error it was raised from is ENOSPC (Megatron's writer wraps it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def save_progress(ckpt_dir) -> int:
    """Bytes written so far by a save of ``ckpt_dir`` (into its ``.tmp-`` folders, every rank's files)."""
    final = Path(ckpt_dir).absolute()
    return sum(_tree_bytes(tmp) for tmp in final.parent.glob(f"{final.name}.tmp-*"))


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; files another rank removes meanwhile count as 0."""
    total = 0
    for folder, _, files in os.walk(path):  # os.walk skips folders that vanish
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


def read_metadata(ckpt_dir) -> dict:
    """The ``megatron_alp.json`` of a complete checkpoint; a clear error otherwise."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: no such checkpoint directory")
    meta_file = ckpt / META_FILE
    if not meta_file.is_file() or not (ckpt / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{ckpt}: not a complete megatron-alp checkpoint ({META_FILE} or Megatron's metadata.json missing)"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return meta


def _requested_model_state(model, meta: dict, base_only: bool) -> dict:
    """The model's sharded state to read from a checkpoint of metadata ``meta``: without the adapters
    when it has none or ``base_only`` (asking for absent gated-fc1 B factors fails in Megatron), and
    without the base weights when it left them out."""
    skip_adapters, skip_base = base_only or not meta.get("lora"), bool(meta.get("lora_base"))
    return {k: v for k, v in model_sharded_state_dict(model).items()
            if not (skip_adapters and is_adapter(k)) and not (skip_base and _is_base_weight(k))}


def _is_optimizer_key(key: str) -> bool:
    """Optimizer state: ``optimizer.``, or ``chained_N.optimizer.`` where Megatron chains optimizers
    (the experts' own one at EP>1)."""
    return re.match(r"(chained_\d+\.)?optimizer\.", key) is not None


def load_checkpoint(ckpt_dir, model, *, optimizer=None, opt_param_scheduler=None, strict=True,
                    base_only=False, base_dir=None) -> dict:
    """Load a checkpoint into ``model`` (any DP/TP/PP/EP layout); returns the saved ``extra`` dict.

    ``strict``: every model parameter must be in the checkpoint and every checkpointed model
    tensor must be used. ALP sigmas are exempt both ways: a checkpoint without them (converted
    from HF, or trained without ALP) leaves the model's initial sigmas, and a model without
    perturbation ignores the checkpoint's.

    ``base_only``: LoRA adapters are neither read nor required, so a LoRA model starts from a
    checkpoint saved without adapters (its adapters keep their initial values), and a model
    without adapters takes the base weights of a LoRA checkpoint. No optimizer state: it belongs
    to the parameters the checkpoint trained, which are not the model's.

    A LoRA checkpoint without base weights (its metadata's ``lora_base``) first fills the model's
    base from the HF folder it records, or from ``base_dir`` (the same weights elsewhere), with
    :func:`~megatron_alp.models.hf_weights.load_hf_weights`; a folder that is gone or holds other
    weights is refused (:func:`~megatron_alp.training.lora_base.verified_base`).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = unwrap_model(model)
    ckpt = Path(ckpt_dir)
    meta = read_metadata(ckpt)
    if meta.get("hf_config"):
        check_model_matches(model, meta["hf_config"], f"{ckpt / META_FILE} (hf_config)")
    if base_only and optimizer is not None:
        raise ValueError(f"{ckpt}: base_only loads the base weights alone; pass no optimizer")
    if strict and not base_only and adapters(model) and not meta.get("lora"):
        raise ValueError(f"{ckpt}: holds no LoRA adapters (saved without them) for this LoRA model; load it with "
                         "base_only=True to take its base weights and keep the adapters' initial values")
    state = {"model": _requested_model_state(model, meta, base_only)}
    if optimizer is not None:
        if not meta.get("has_optimizer"):
            raise ValueError(f"{ckpt}: holds no optimizer state (saved without an optimizer)")
        _check_optimizer_format(ckpt, meta.get("layout", {}), optimizer)
        check_optimizer_groups(optimizer)
        _prepare_optimizer_for_load(optimizer)
        with _optimizer_state_io(optimizer, loading=True):
            state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True, metadata=OPTIMIZER_METADATA)
    if opt_param_scheduler is not None:
        if not meta.get("has_scheduler"):
            raise ValueError(f"{ckpt}: holds no learning-rate scheduler state")
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    from_folder = bool(meta.get("lora_base"))  # the base weights are not in the checkpoint: read after the checks
    if from_folder:
        load_hf_weights(model, verified_base(ckpt, meta["lora_base"], base_dir).dir)
    loaded, ckpt_only, model_only = dist_checkpointing.load(state, str(ckpt), strict=StrictHandling.RETURN_ALL)
    missing_sigmas = sorted(k for k in model_only if is_sigma(k))
    if missing_sigmas and any(is_sigma(k) for k in ckpt_only) and _rank() == 0:
        logging.getLogger(__name__).warning(
            "%s: ALP sigmas were saved for other layers than the model perturbs; %s keep their initial value",
            ckpt, ", ".join(missing_sigmas),
        )
    if strict:
        absent = sorted(k for k in model_only if not is_sigma(k))
        unused = sorted(k for k in ckpt_only if not is_sigma(k) and not _is_optimizer_key(k)
                        and not (base_only and is_adapter(k)))
        if absent:
            raise ValueError(f"{ckpt}: has no tensor {absent[0]} for the model ({len(absent)} missing)")
        if unused:
            raise ValueError(f"{ckpt}: tensor {unused[0]} has no place in the model ({len(unused)} unused)")
    result = model.load_state_dict(loaded["model"], strict=False)
    if strict:
        left = [k for k in result.missing_keys if not is_sigma(k) and not k.endswith("_extra_state")
                and not (base_only and is_adapter(k)) and not (from_folder and _is_base_weight(k))]
        if left:
            raise ValueError(f"{ckpt}: no value for model parameter {left[0]}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_optimizer_steps(optimizer)
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    extra_file = ckpt / EXTRA_FILE
    return torch.load(extra_file, weights_only=False) if extra_file.is_file() else {}


def checkpoints_newest_first(run_dir) -> list[Path]:
    """The complete checkpoints under ``run_dir/checkpoints/``, newest (iteration, step, save time) first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if not d.is_dir() or ".tmp-" in d.name or ".old-" in d.name:
            continue
        try:
            meta = read_metadata(d)
        except (FileNotFoundError, ValueError, json.JSONDecodeError):
            continue
        extra = meta["extra"]
        found.append(((extra.get("iteration", -1), extra.get("step", -1), meta.get("saved_at", 0.0)), d))
    return [d for _, d in sorted(found, key=lambda kd: kd[0], reverse=True)]


def latest_checkpoint(run_dir) -> Optional[Path]:
    """The newest complete checkpoint under ``run_dir/checkpoints/`` (None if there is none)."""
    found = checkpoints_newest_first(run_dir)
    return found[0] if found else None


def intact_checkpoint(run_dir, log: Callable[[str], None]) -> Optional[Path]:
    """Collective: the newest checkpoint whose files still match their checksums; each damaged
    newer one is skipped with one ``log`` line saying what is wrong and which one is used instead."""
    found = checkpoints_newest_first(run_dir)
    for i, ckpt in enumerate(found):
        problem = damage(ckpt)
        if problem is None:
            return ckpt
        instead = f"resuming from {found[i + 1].name}" if i + 1 < len(found) else "no earlier checkpoint is left"
        log(f"checkpoint {ckpt} is damaged ({problem}): {instead}")
    return None
