"""Hugging Face safetensors <-> this rank's Megatron-Core model stage.

:func:`load_hf_weights` fills a (TP/PP/EP-sliced) GPTModel from an HF directory, one parameter at
a time: only the tensors this rank needs are read, and a shard file is closed (unmapped) as soon
as no remaining parameter needs it, so memory stays at the model stage plus one parameter's
inputs. :func:`iter_hf_weights` is the inverse, used by the HF export and by the rollout engine's
weight sync: a collective (:func:`gather_full`, which the PEFT adapter export shares) that gathers
each tensor across TP, EP and PP in bounded buckets and yields HF-named full tensors, on every rank
or only on the ranks that ask for them (the engines' leaders). A model with LoRA adapters exports
its merged weights ``W + s B A``, never the adapters themselves. Both place weights by
:mod:`megatron_alp.models.weight_mapping`. :mod:`megatron_alp.models.hf_delta` streams the same
weights as exact deltas against what the receivers already hold.
:func:`write_hf_folder` writes such a stream as an HF directory, for the export and for the
rollout engines that reload from disk alike. :func:`hf_fingerprint` identifies a folder's weights
cheaply (what a LoRA checkpoint records of its base). Megatron-Core is imported inside the
functions that use it: the rollout engines (and so config validation) import this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.sharding import gather_tp, partition_dim_of, shard
from megatron_alp.models.weight_mapping import Match, WeightMapping, is_adapter, is_sigma

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# What an HF model directory holds besides its config and tokenizer files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


class HFCheckpoint:
    """The tensors of an HF safetensors directory (single file, or index + shards), read lazily."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index with a `weight_map` ({err})") from None
            self.location = {name: self.dir / f for name, f in weight_map.items()}
        else:
            files = [self.dir / SINGLE_FILE] if (self.dir / SINGLE_FILE).is_file() else sorted(
                self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.dir}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                    "PyTorch .bin checkpoints are not supported"
                )
            self.location = {name: f for f in files for name in _header_names(f)}
        for f, names in _group_by_file(self.location).items():
            if not f.is_file():
                raise FileNotFoundError(
                    f"{f}: shard listed in {INDEX_FILE} is missing (it holds {len(names)} tensors, "
                    f"e.g. {names[0]})"
                )
        self._open: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.location)

    def dtype(self) -> torch.dtype:
        """The most common floating dtype of the stored tensors (the checkpoint's precision)."""
        counts: Counter = Counter()
        for f, names in _group_by_file(self.location).items():
            handle = self._handle(f)
            for n in names:
                counts[handle.get_slice(n).get_dtype()] += 1
            self.close(f)
        for code, _ in counts.most_common():
            if code in _DTYPES:
                return _DTYPES[code]
        return torch.float32

    def _handle(self, f: Path):
        from safetensors import safe_open

        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt")
        return self._open[f]

    def read(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        f = self.location[name]
        try:
            return self._handle(f).get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"{f}: does not contain tensor {name} ({err})") from None

    def close(self, f: Optional[Path] = None) -> None:
        for key in [f] if f is not None else list(self._open):
            self._open.pop(key, None)


def _header_names(f: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as h:
        return list(h.keys())


def _group_by_file(location: dict[str, Path]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for name, f in location.items():
        out.setdefault(f, []).append(name)
    return out


# --------------------------------------------------------------------------- fingerprint

FINGERPRINT_WINDOW = 4096  # bytes read at each sampled place of a tensor
FINGERPRINT_WINDOWS = 4  # places per tensor: its first and last bytes and two between


def hf_fingerprint(hf_dir) -> tuple[str, int, int]:
    """A fingerprint of the weights of the HF safetensors folder ``hf_dir``: (sha256 hex digest, tensors,
    bytes). The digest runs over every tensor in name order: its name, dtype and shape from the file
    headers, and ``FINGERPRINT_WINDOWS`` windows of ``FINGERPRINT_WINDOW`` bytes spread evenly over its
    data (a tensor that small, all of it).

    Deterministic and about the weights alone: neither paths, times nor how the tensors are spread
    over shard files enter it, so a copy of a folder has its fingerprint. Sampled rather than whole:
    hashing every byte of a 32B base reads 61 GiB on each save and resume, while these windows read
    16 KiB per tensor. Headers and sizes alone would miss what matters most, another model of the
    same shapes (a retrained or re-warm-started base); any retraining changes a visible share of the
    elements (one RL step at a typical learning rate 1-3% of bf16 ones), which a window of 2048
    bf16 elements misses with odds below 1e-9. What escapes is an edit of a few
    elements outside the windows."""
    location = HFCheckpoint(hf_dir).location
    digest, total = hashlib.sha256(), 0
    with contextlib.ExitStack() as stack:
        files = {f: stack.enter_context(open(f, "rb")) for f in set(location.values())}
        headers = {f: _safetensors_header(fh) for f, fh in files.items()}
        for name in sorted(location):
            fh, (header, start) = files[location[name]], headers[location[name]]
            entry = header.get(name)
            if entry is None:
                raise ValueError(f"{location[name]}: does not contain tensor {name} (listed in {INDEX_FILE})")
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
            for at in _windows(end - begin):
                fh.seek(start + begin + at)
                digest.update(fh.read(min(FINGERPRINT_WINDOW, end - begin - at)))
            total += end - begin
    return digest.hexdigest(), len(location), total


def _safetensors_header(fh) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data offsets) and where its data starts."""
    size = int.from_bytes(fh.read(8), "little")
    return json.loads(fh.read(size)), 8 + size


def _windows(nbytes: int) -> list[int]:
    """Offsets of the windows :func:`hf_fingerprint` reads in a tensor of ``nbytes``."""
    if nbytes <= FINGERPRINT_WINDOW * FINGERPRINT_WINDOWS:
        return list(range(0, nbytes, FINGERPRINT_WINDOW))
    last = nbytes - FINGERPRINT_WINDOW
    return [last * i // (FINGERPRINT_WINDOWS - 1) for i in range(FINGERPRINT_WINDOWS)]


# --------------------------------------------------------------------------- rank-local params

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def global_name(name: str, model) -> str:
    """Name of this stage's parameter in the whole model: global layer and expert indices."""
    from megatron.core import parallel_state as ps

    m = _LAYER.match(name)
    if m:
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1
        name = f"decoder.layers.{layer}." + name[m.end():]
    if model.config.num_moe_experts:
        per_rank = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        offset = ps.get_expert_model_parallel_rank() * per_rank
        name = _LOCAL_EXPERT.sub(lambda e: f".local_experts.{offset + int(e.group(1))}.", name)
        name = _GROUPED_EXPERT.sub(lambda e: f"{e.group(1)}{offset + int(e.group(2))}", name)
    return name


class LocalTensor:
    """One tensor of this rank's stage to export whole: how it is split over tensor parallelism (the
    expert-TP group for routed experts) and what to send. A base weight with a LoRA adapter beside it
    sends the merged ``W + s B A``, so every full-weight export is the merged model."""

    def __init__(self, name: str, param: torch.Tensor, partition_dim: Optional[int], expert: bool, adapter=None):
        from megatron.core import parallel_state as ps

        self.name, self.param, self.partition_dim, self.expert = name, param, partition_dim, expert
        self.adapter = adapter
        if expert:
            self.group = ps.get_expert_tensor_parallel_group()
            self.tp_rank = ps.get_expert_tensor_parallel_rank()
            self.tp_size = ps.get_expert_tensor_parallel_world_size()
        else:
            self.group = ps.get_tensor_model_parallel_group()
            self.tp_rank = ps.get_tensor_model_parallel_rank()
            self.tp_size = ps.get_tensor_model_parallel_world_size()

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)

    def value(self) -> torch.Tensor:
        """This rank's shard to send: the parameter, or the merged weight of an adapted layer."""
        if self.adapter is None:
            return self.param.detach()
        from megatron_alp.models.lora import merged_weight

        return merged_weight(self.adapter)


class _Param(LocalTensor):
    """One local parameter with its mapping rule, which says how it is split over tensor parallelism."""

    def __init__(self, name: str, param: torch.Tensor, match: Match, adapter=None):
        self.match = match
        partition_dim = match.rule.tp_dim
        recorded = partition_dim_of(param) if hasattr(param, "partition_dim") else partition_dim
        # Experts: with EP > 1 or expert TP > 1 Megatron shards them itself and hides the split from
        # Transformer Engine, whose layers then stamp a meaningless `partition_dim=0` on every weight;
        # the rule is the truth there. Everywhere else a disagreement means a wrong mapping.
        if recorded != partition_dim and not match.rule.is_expert:
            raise ValueError(
                f"{name}: Megatron splits it over tensor parallelism along dim {recorded}, the weight "
                f"mapping says {partition_dim}"
            )
        super().__init__(name, param, partition_dim, match.rule.is_expert, adapter)


def local_params(model, mapping: WeightMapping) -> list[_Param]:
    """This rank's parameters (ALP sigmas and LoRA adapters excluded), each resolved to its mapping
    rule; an adapted weight carries its adapter (see :meth:`LocalTensor.value`)."""
    from megatron_alp.models.lora import adapters_by_weight

    out = []
    tied_output = model.share_embeddings_and_output_weights
    adapted = adapters_by_weight(model)
    for name, p in model.named_parameters():
        if is_sigma(name) or is_adapter(name):
            continue
        if name == "output_layer.weight" and tied_output:
            # a later pipeline stage's copy of the tied embedding
            match = mapping.match("embedding.word_embeddings.weight")
        else:
            match = mapping.match(global_name(name, model))
        out.append(_Param(name, p, match, adapted.get(name)))
    return out


def check_model_matches(model, hf_config: dict, source: str) -> None:
    """Refuse an HF config that describes another model than the built one (by field)."""
    args = hf_to_megatron(hf_config)
    t, c = args.transformer, model.config
    fields = [
        ("num_hidden_layers", t["num_layers"], c.num_layers),
        ("hidden_size", t["hidden_size"], c.hidden_size),
        ("num_attention_heads", t["num_attention_heads"], c.num_attention_heads),
        ("num_key_value_heads", t["num_query_groups"], c.num_query_groups),
        ("head_dim", t["kv_channels"], c.kv_channels),
        ("intermediate_size", t["ffn_hidden_size"], c.ffn_hidden_size),
        ("num_experts", t.get("num_moe_experts"), c.num_moe_experts),
        ("moe_intermediate_size", t.get("moe_ffn_hidden_size"), c.moe_ffn_hidden_size if c.num_moe_experts else None),
        ("vocab_size", args.vocab_size, model.vocab_size),
        ("tie_word_embeddings", args.tie_word_embeddings, model.share_embeddings_and_output_weights),
        ("attention bias", t["add_qkv_bias"], c.add_qkv_bias),
        ("qk norm", t["qk_layernorm"], c.qk_layernorm),
    ]
    for field, hf_value, model_value in fields:
        if hf_value != model_value:
            raise ValueError(f"{source}: `{field}` is {hf_value!r} but the Megatron model has {model_value!r}")


# ----------------------------------------------------------------------------------- loading


def open_hf_checkpoint(hf_dir) -> tuple[dict, WeightMapping, HFCheckpoint]:
    """Config, mapping and tensor index of an HF directory, checked against each other: every
    tensor the family's mapping expects is there, and every stored tensor has a place (an error
    names the first offender). Reads only file headers."""
    hf_dir = Path(hf_dir)
    hf_config = load_hf_config(hf_dir)
    mapping = WeightMapping.from_hf_config(hf_config)
    ckpt = HFCheckpoint(hf_dir)
    expected = mapping.hf_names()
    available = set(ckpt.names())
    missing = [n for n in expected if n not in available]
    if missing:
        raise ValueError(f"{hf_dir}: tensor {missing[0]} is missing ({len(missing)} expected tensors missing)")
    unexpected = sorted(available - set(expected) - {n for n in available if mapping.is_ignored_hf(n)})
    if not mapping.flags["untied"]:
        unexpected = [n for n in unexpected if n != "lm_head.weight"]  # some tied checkpoints store a copy
    if unexpected:
        raise ValueError(
            f"{hf_dir}: tensor {unexpected[0]} has no Megatron parameter in the {mapping.family} mapping "
            f"({len(unexpected)} unmapped tensors); refusing to drop weights silently"
        )
    return hf_config, mapping, ckpt


def load_hf_weights(model, hf_dir) -> None:
    """Fill this rank's GPTModel stage from the HF safetensors directory ``hf_dir``.

    Checks first that the directory holds exactly the tensors the family's mapping expects (see
    :func:`open_hf_checkpoint`), then streams: per parameter, read its HF tensors, fuse them (QKV,
    gate/up), take this rank's TP slice and copy it in. ALP sigmas keep their initial value.
    Raises ValueError naming the tensor on any shape mismatch.
    """
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model)
    hf_config, mapping, ckpt = open_hf_checkpoint(hf_dir)
    check_model_matches(model, hf_config, str(Path(hf_dir) / "config.json"))
    params = local_params(model, mapping)
    # Visit parameters grouped by shard file and release each file once nothing else needs it.
    order = sorted(params, key=lambda p: min(str(ckpt.location[n]) for n in p.match.hf_names))
    pending = Counter(ckpt.location[n] for p in order for n in p.match.hf_names)
    with torch.no_grad():
        for p in order:
            names = p.match.hf_names
            tensors = [ckpt.read(n) for n in names]
            for n in names:
                pending[ckpt.location[n]] -= 1
                if pending[ckpt.location[n]] == 0:
                    ckpt.close(ckpt.location[n])
            full = mapping.to_mcore(p.match, tensors)
            if tuple(full.shape) != p.full_shape:
                raise ValueError(
                    f"{', '.join(names)}: shape {tuple(full.shape)} does not fit Megatron parameter "
                    f"{p.match.name} of shape {p.full_shape}"
                )
            piece = shard(full, p.match.name, p.partition_dim, p.tp_rank, p.tp_size, gated=True)
            p.param.copy_(piece)
            del tensors, full, piece
    ckpt.close()


# ----------------------------------------------------------------------------------- export


class ExportPlan:
    """Who owns which full tensor: (pipeline stage, expert-parallel rank or None), plus shapes, how
    each is split over its tensor-parallel group (``splits``: name -> (partition dim or None, group
    size), for ranks that hold no shard of it), and the (pipeline stage, expert-parallel rank) of
    every global rank. ``local`` holds this rank's tensors by a name that is the same on every rank;
    ``order`` is the export order, and a name no rank holds is an error when ``required`` (the
    model's weights), else skipped (adapters, which only the target layers have)."""

    def __init__(self, model, local: dict[str, LocalTensor], order: Iterable[str], *, required: bool = True):
        from megatron.core import parallel_state as ps

        self.local = local
        pp_rank = ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank() if model.config.num_moe_experts else 0
        mine = {
            name: (pp_rank, ep_rank if p.expert else None, p.full_shape, str(p.param.dtype).removeprefix("torch."),
                   (p.partition_dim, p.tp_size))
            for name, p in local.items()
        }
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, ((pp_rank, ep_rank), mine))
        self.coords = [coords for coords, _ in parts]
        owners: dict = {}
        for _, part in parts:
            owners.update(part)
        self.entries, self.splits = [], {}
        for name in order:
            if name not in owners:
                if required:
                    raise RuntimeError(f"no rank holds Megatron parameter {name}; cannot export the model")
                continue
            stage, ep_owner, shape, dtype, self.splits[name] = owners[name]
            self.entries.append((name, stage, ep_owner, shape, getattr(torch, dtype)))

    def owns(self, rank: int, stage: int, ep_owner: Optional[int]) -> bool:
        """Whether global ``rank`` holds the shards of (``stage``, ``ep_owner``)'s tensors."""
        pp, ep = self.coords[rank]
        return pp == stage and (ep_owner is None or ep == ep_owner)

    def buckets(self, bucket_bytes: int):
        """Consecutive entries with one owner and dtype, at most ``bucket_bytes`` (or one tensor)."""
        bucket, size, key = [], 0, None
        for entry in self.entries:
            _, stage, ep_owner, shape, dtype = entry
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if bucket and ((stage, ep_owner, dtype) != key or size + nbytes > bucket_bytes):
                yield bucket
                bucket, size = [], 0
            bucket.append(entry)
            size += nbytes
            key = (stage, ep_owner, dtype)
        if bucket:
            yield bucket

    def sources(self, stage: int, ep_owner: Optional[int], receivers: list[int]) -> dict[int, int]:
        """Receiver -> the owner that sends it the buckets of (``stage``, ``ep_owner``), for each
        receiver that owns none: the receivers in rank order dealt round robin over the owners (every
        rank of that stage, and expert-parallel rank, holds the bucket after the TP all-gather), so
        no owner serves more than its share of receivers."""
        owners = [r for r in range(len(self.coords)) if self.owns(r, stage, ep_owner)]
        needy = [r for r in receivers if r not in owners]
        return {r: owners[i % len(owners)] for i, r in enumerate(needy)}


def _tied_copy(p: _Param) -> bool:
    return p.name == "output_layer.weight" and p.match.name == "embedding.word_embeddings.weight"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def iter_hf_weights(model, bucket_bytes: int = 512 << 20, receivers: Optional[Iterable[int]] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, in HF file order, on every rank of
    ``receivers`` (global ranks, the same on every rank; None: every rank).

    Collective: every rank of the job must iterate it to the end (see :func:`gather_full`; the
    fused QKV and gate/up layouts are undone by the mapping). ALP sigmas and LoRA factors are never
    yielded: a layer with a LoRA adapter yields its merged weight ``W + s B A``, so the stream is the
    merged model.
    """
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model)
    plan, mapping, matches = export_plan(model)
    for name, full in gather_full(model, plan, bucket_bytes, receivers):
        yield from mapping.to_hf(matches[name], full)


def export_plan(model) -> tuple[ExportPlan, WeightMapping, dict[str, Match]]:
    """The export plan of a (unwrapped) model's weights, its mapping and its matches by Megatron
    name; made once per model (collective the first time) and cached on it."""
    cached = getattr(model, "_hf_export_plan", None)
    if cached is None:
        mapping = WeightMapping.from_model(model)
        local = {p.match.name: p for p in local_params(model, mapping) if not _tied_copy(p)}
        matches = {m.name: m for m in mapping.matches()}
        cached = model._hf_export_plan = (ExportPlan(model, local, matches), mapping, matches)
    return cached


def check_receivers(receivers: Optional[Iterable[int]]) -> Optional[list[int]]:
    """``receivers`` sorted without repeats (None stays None: every rank), refused unless they are
    ranks of this job."""
    if receivers is None:
        return None
    wanted = sorted(set(receivers))
    if wanted and not 0 <= wanted[0] <= wanted[-1] < dist.get_world_size():
        raise ValueError(f"receivers {wanted}: not ranks of this {dist.get_world_size()}-rank job")
    return wanted


def gather_full(model, plan: ExportPlan, bucket_bytes: int, receivers: Optional[Iterable[int]] = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of ``plan``, in its order, on every rank of
    ``receivers`` (global ranks, the same on every rank; None: every rank).

    Collective: every rank of the job must iterate it to the end. Tensors (:meth:`LocalTensor.value`)
    are gathered across TP (all-gather) in buckets of at most ``bucket_bytes``. With
    ``receivers=None`` each bucket is then broadcast across EP (from the expert's owner) and PP (from
    the owning stage). Otherwise only the receivers get it, point to point from one owner each
    (:meth:`ExportPlan.sources`): a rank that neither owns nor receives a bucket skips it, so the
    ranks that feed no engine move only their TP all-gather share instead of the whole model.
    Yielded tensors may be views into their bucket's buffer, which is freshly allocated per bucket
    and never overwritten: keeping one keeps its bucket alive.
    """
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    wanted = check_receivers(receivers)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    ep_rank = ps.get_expert_model_parallel_rank() if model.config.num_moe_experts else 0
    ep_size = ps.get_expert_model_parallel_world_size() if model.config.num_moe_experts else 1
    device = next(model.parameters()).device
    with torch.no_grad():
        for bucket in plan.buckets(bucket_bytes):
            _, stage, ep_owner, _, dtype = bucket[0]
            owner = pp_rank == stage and (ep_owner is None or ep_owner == ep_rank)
            if wanted is not None:
                sources = plan.sources(stage, ep_owner, wanted)
                if not owner and rank not in sources:
                    continue
            sizes = [_numel(e[3]) for e in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            if owner:
                offset = 0
                for (name, *_), n in zip(bucket, sizes):
                    p = plan.local[name]
                    full = gather_tp(p.value(), name, p.partition_dim, p.group, gated=True)
                    flat[offset: offset + n].copy_(full.reshape(-1))
                    offset += n
            if wanted is None:
                if ep_owner is not None and ep_size > 1 and pp_rank == stage:
                    group = ps.get_expert_model_parallel_group()
                    dist.broadcast(flat, src=dist.get_global_rank(group, ep_owner), group=group)
                if pp_size > 1:
                    group = ps.get_pipeline_model_parallel_group()
                    dist.broadcast(flat, src=dist.get_global_rank(group, stage), group=group)
            else:
                send_to_receivers(flat, rank, sources)
                if rank not in wanted:
                    continue
            for (name, _, _, shape, _), piece in zip(bucket, torch.split(flat, sizes)):
                yield name, piece.view(shape)
            del flat


def send_to_receivers(flat: torch.Tensor, rank: int, sources: dict[int, int]) -> None:
    """This rank's part of one bucket's delivery (``sources``: receiver -> owner): the sends it was
    dealt and its receive, on the default group, whose backend takes the bucket on the model's
    device (NCCL on GPUs, gloo on the CPU)."""
    ops = [dist.P2POp(dist.isend, flat, dst) for dst, src in sources.items() if src == rank]
    if rank in sources:
        ops.append(dist.P2POp(dist.irecv, flat, sources[rank]))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ----------------------------------------------------------------------------------- writing

_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def make_tmp_dir(final: Path) -> str:
    """``<final>.tmp-XXXX`` with the permissions an ordinary ``mkdir`` would give (not 0700)."""
    tmp = tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def copy_hf_side_files(src, dst) -> None:
    """Copy the tokenizer, generation config, chat template and any other file of the HF
    directory ``src`` except weights and ``config.json``: the config is written from the one
    place it is recorded (a checkpoint's metadata), so a stale copy can never disagree with it."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES) \
                and f.name not in WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file tensor by tensor (``safetensors.torch.save_file`` first copies
    every tensor into one bytes object, doubling a shard's memory, and refuses views that share
    a buffer, which the exporter's buckets are)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_hf_folder(
    weights: Iterable[tuple[str, torch.Tensor]], out_dir, *, max_shard_bytes: int,
    add_files: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write ``(HF name, tensor)`` pairs as the HF safetensors folder ``out_dir``; returns it.

    Shards hold at most ``max_shard_bytes`` (a larger tensor gets a shard of its own) and are
    named as transformers names them, with an index when there are several. A shard's tensors are
    kept by reference until it is written, so memory stays at one shard; a source must not
    overwrite a tensor it has yielded. ``add_files(tmp)`` adds the non-weight files (config,
    tokenizer). Atomic: built in ``<out>.tmp-XXXX`` and renamed, so the folder appears complete
    under its name or not at all. An existing ``out_dir`` is refused.
    """
    out = Path(out_dir).absolute()
    if out.exists():
        raise FileExistsError(f"{out}: refusing to overwrite an existing folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(make_tmp_dir(out))
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        write_safetensors(tmp / f"part-{len(shards):05d}.safetensors", pending)
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    try:
        for name, tensor in weights:
            if name in seen:
                raise ValueError(f"weight {name} appears twice in the stream")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if pending and pending_bytes + nbytes > max_shard_bytes:
                flush()
            pending[name] = tensor.detach().cpu()
            pending_bytes += nbytes
            total += nbytes
        if pending:
            flush()
        if not shards:
            raise ValueError("the weight stream was empty: nothing to write")
        if len(shards) == 1:
            os.replace(tmp / "part-00000.safetensors", tmp / SINGLE_FILE)
        else:
            weight_map = {}
            for i, names in enumerate(shards):
                final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                os.replace(tmp / f"part-{i:05d}.safetensors", tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if add_files is not None:
            add_files(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
