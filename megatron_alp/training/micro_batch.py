"""A rank's sequences -> the micro-batches of one forward/backward pass: padded rows or packed rows.

RL responses have long-tailed lengths, so how sequences are grouped decides how much padding is
computed and how even the work is. Three ways, chosen by the trainer config:

- **rows** (``micro_batch_size``): a fixed count of right-padded rows, longest first.
- **token budget, padded** (``max_tokens``): as many length-sorted rows as fit in ``max_tokens``
  computed tokens (rows x longest row).
- **token budget, packed** (``max_tokens`` and ``pack``): bins of at most ``max_tokens`` tokens,
  balanced by greedy LPT, whose sequences are laid end to end with per-sequence positions and no
  attention across sequences, so (almost) no pad token is computed. With the Transformer-Engine
  layer spec a bin is one row in Megatron's THD layout (:meth:`MicroBatch.packed_seq_params`,
  variable-length flash attention). Megatron's local attention rejects THD and materialises
  ``[T, T]`` scores, so there a micro-batch is length-sorted rows as under a padded budget, with the
  short sequences sharing rows first-fit, under a block-diagonal causal mask
  (:meth:`MicroBatch.attention_mask`).

Every micro-batch keeps the padded per-sequence view of its sequences (``batch``), which the loss
and the logprob results use; :meth:`MicroBatch.unpack` maps per-token model outputs onto it.

Expert parallelism runs an all-to-all in every MoE layer of every micro-batch, so the ranks of an
expert-parallel group must run the same number of micro-batches. ``min_count`` splits the
micro-batches with the most sequences until there are that many, and where a rank has fewer
sequences than that, adds *fillers*: repeats of its smallest micro-batch with no loss tokens and
zero advantages, which take part in the collectives and change nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_alp.algorithms.balance import partition
from megatron_alp.config import TrainerConfig
from megatron_alp.training.rl_batch import RLBatch


@dataclass
class MicroBatch:
    batch: RLBatch  # the sequences, padded view [n, L]: loss inputs and results
    rows: torch.Tensor  # [n] the sequences' rows in the batch they were cut from
    tokens: torch.Tensor  # [r, T] model input ids
    targets: torch.Tensor  # [r, T]
    positions: torch.Tensor  # [r, T] position of each token within its own sequence
    segments: Optional[torch.Tensor] = None  # packed: [r, T] sequence number of each token (pad tails too)
    index: Optional[torch.Tensor] = None  # packed: [n, L] flat position in [r * T] of each padded-view token
    filler: bool = False  # a repeat that only keeps collectives in step: no loss tokens, zero advantages

    @property
    def packed(self) -> bool:
        return self.segments is not None

    @property
    def computed_tokens(self) -> int:
        return self.tokens.numel()

    def _inside(self, device) -> torch.Tensor:
        """``[n, L]``: True on each sequence's own positions of the padded view."""
        width = self.batch.tokens.shape[1]
        return torch.arange(width, device=device) < self.batch.lengths.to(device).unsqueeze(1)

    def unpack(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """Per-token model outputs ``[r, T, ...]`` -> the padded view ``[n, L, ...]`` (``fill`` past
        each sequence)."""
        width = self.batch.tokens.shape[1]
        inside = self._inside(values.device)
        if self.packed:
            picked = values.reshape(-1, *values.shape[2:])[self.index.to(values.device)]
        else:
            picked = values[:, :width]
        inside = inside.reshape(*inside.shape, *([1] * (picked.dim() - 2)))
        return torch.where(inside, picked, values.new_full((), fill))

    def layout(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """The inverse of :meth:`unpack`: per-sequence values in the padded view ``[n, L, ...]`` ->
        this micro-batch's rows ``[r, T, ...]``, ``fill`` on pad positions."""
        rows, width = self.tokens.shape
        out = values.new_full((rows * width if self.packed else rows, *([] if self.packed else [width]),
                               *values.shape[2:]), fill)
        inside = self._inside(values.device)
        if self.packed:
            out[self.index.to(values.device)[inside]] = values[inside]
            return out.reshape(rows, width, *values.shape[2:])
        out[:, : values.shape[1]] = torch.where(
            inside.reshape(*inside.shape, *([1] * (values.dim() - 2))), values, values.new_full((), fill))
        return out

    def attention_mask(self) -> Optional[torch.Tensor]:
        """Block-diagonal causal mask ``[r, 1, T, T]`` (True = masked, Megatron's convention) for
        packed rows under Megatron's local attention; None for padded rows (Megatron's causal mask)."""
        if not self.packed:
            return None
        seg = self.segments.to(self.tokens.device)
        t = torch.arange(seg.shape[1], device=seg.device)
        allowed = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (t.unsqueeze(0) <= t.unsqueeze(1))
        return (~allowed).unsqueeze(1)

    def packed_seq_params(self) -> Optional[PackedSeqParams]:
        """Megatron's THD description of a one-row packed micro-batch (Transformer-Engine attention,
        RoPE per sequence): the segment bounds as ``cu_seqlens``, a pad tail included."""
        if not self.packed:
            return None
        if self.segments.shape[0] != 1:
            raise ValueError("THD packing needs one packed row per micro-batch (micro_batches(one_row=True))")
        seg = self.segments[0]
        starts = torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1
        cu = torch.cat([seg.new_zeros(1), starts, seg.new_full((1,), seg.numel())]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max().item())
        cu = cu.to(self.tokens.device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def to(self, device) -> "MicroBatch":
        return dataclasses.replace(
            self, batch=self.batch.to(device), tokens=self.tokens.to(device), targets=self.targets.to(device),
            positions=self.positions.to(device),
        )


@dataclass(frozen=True)
class Batching:
    """How a pass cuts its sequences: ``size`` rows, or a ``max_tokens`` budget (``pack``-ed or not)."""

    size: Optional[int] = None
    max_tokens: Optional[int] = None
    pack: bool = False

    def __post_init__(self):
        if (self.size is None) == (self.max_tokens is None):
            raise ValueError("Batching: give exactly one of size (rows) and max_tokens (a token budget)")
        if self.pack and self.max_tokens is None:
            raise ValueError("Batching: packing needs a token budget (max_tokens)")

    @classmethod
    def for_update(cls, trainer: TrainerConfig) -> "Batching":
        budget = trainer.max_tokens_per_micro_batch
        return cls(None if budget else trainer.micro_batch_size, budget, trainer.sequence_packing)

    @classmethod
    def for_logprobs(cls, trainer: TrainerConfig) -> "Batching":
        budget = trainer.logprob_max_tokens_per_micro_batch or trainer.max_tokens_per_micro_batch
        return cls(None if budget else trainer.micro_batch_size, budget, trainer.sequence_packing)


def micro_batches(
    batch: RLBatch,
    batching: Batching,
    *,
    pad_id: int,
    pad_multiple: int = 1,
    one_row: bool = True,
    equal_length: bool = False,
    min_count: int = 1,
) -> list[MicroBatch]:
    """Cut ``batch`` into micro-batches as ``batching`` says. Row widths are padded to
    ``pad_multiple`` (sequence parallelism shards them). A packed micro-batch is ``one_row`` (THD:
    LPT-balanced bins), or, for attention that takes a dense mask, rows as wide as its longest
    sequence that short sequences share (the mask costs rows x width^2, not budget^2).
    ``equal_length`` pads every one-row micro-batch to the longest (one shape for pipeline-parallel
    communication). ``min_count``: at least this many micro-batches, split or with fillers (see the
    module docstring)."""
    micro = _cut(batch, batching, pad_id, pad_multiple, one_row, equal_length, min_count)
    if micro and len(micro) < min_count:
        smallest = min(micro, key=lambda m: (m.computed_tokens, len(m.rows)))
        micro += [_filler(smallest) for _ in range(min_count - len(micro))]
    return micro


def _filler(mb: MicroBatch) -> MicroBatch:
    b = mb.batch
    quiet = dataclasses.replace(b, loss_mask=torch.zeros_like(b.loss_mask), advantages=torch.zeros_like(b.advantages))
    return dataclasses.replace(mb, batch=quiet, filler=True)


def _halve(seqs: list[int]) -> list[list[int]]:
    """Two groups of alternate members of a length-sorted group: their sizes stay close."""
    return [seqs[0::2], seqs[1::2]]


def _halve_rows(rows: list[list[int]]) -> list[list[list[int]]]:
    """A micro-batch of packed rows splits by rows; one row by its sequences."""
    return [rows[0::2], rows[1::2]] if len(rows) > 1 else [[half] for half in _halve(rows[0])]


def _split(groups: list, min_count: int, sequences, tokens, halve) -> list:
    """Halve the group with the most sequences (then the most tokens) until there are
    ``min_count`` groups or none has two sequences."""
    groups = list(groups)
    while len(groups) < min_count:
        i = max(range(len(groups)), key=lambda k: (sequences(groups[k]), tokens(groups[k]), -k))
        if sequences(groups[i]) < 2:
            break
        groups[i:i + 1] = halve(groups[i])
    return groups


def _cut(batch: RLBatch, batching: Batching, pad_id: int, pad_multiple: int, one_row: bool, equal_length: bool,
         min_count: int) -> list[MicroBatch]:
    lengths = batch.lengths.tolist()
    budget = batching.max_tokens
    if budget is not None and lengths and max(lengths) > budget:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens does not fit the micro-batch token budget of {budget}: "
            "raise trainer.max_tokens_per_micro_batch (and logprob_max_tokens_per_micro_batch) to at least "
            "the engine context (rollout.max_model_len)"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def tokens(seqs):
        return sum(lengths[i] for i in seqs)

    if batching.pack and one_row:
        bins = _split(_packed_bins(lengths, budget), min_count, len, tokens, _halve)
        width = max(tokens(b) for b in bins) if equal_length and bins else None
        return [_packed(batch, [b], pad_id, pad_multiple, width) for b in bins]
    if batching.pack:
        layouts = _split(_row_groups(order, lengths, budget), min_count, lambda rows: sum(map(len, rows)),
                         lambda rows: sum(map(tokens, rows)), _halve_rows)
        return [_packed(batch, rows, pad_id, pad_multiple, None) for rows in layouts]
    groups = (_budget_groups(order, lengths, budget) if budget is not None
              else [order[i: i + batching.size] for i in range(0, len(order), batching.size)])
    groups = _split(groups, min_count, len, tokens, _halve)
    return [_padded(batch, torch.tensor(g), pad_id, pad_multiple) for g in groups]


def _budget_groups(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Longest-first rows, as many per group as fit ``max_tokens`` computed (padded) tokens."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _packed_bins(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The fewest LPT-balanced bins of at most ``max_tokens`` tokens: start from the lower bound
    ceil(total / max_tokens) and add a bin until LPT's split fits."""
    if not lengths:
        return []
    count = -(-sum(lengths) // max_tokens)
    while True:
        bins = [b for b in partition(lengths, count) if b]
        if all(sum(lengths[i] for i in b) <= max_tokens for b in bins):
            return bins
        count += 1


def _padded(batch: RLBatch, rows: torch.Tensor, pad_id: int, pad_multiple: int) -> MicroBatch:
    view = batch.select(rows)
    wide = view.pad_to_multiple(pad_multiple, pad_id)
    positions = torch.arange(wide.tokens.shape[1]).unsqueeze(0).expand(len(rows), -1)
    return MicroBatch(batch=view, rows=rows, tokens=wide.tokens, targets=wide.targets, positions=positions)


def _row_groups(order: list[int], lengths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """Longest-first sequences into micro-batches of rows as wide as the micro-batch's first
    (longest) sequence, each sequence into the first row with room: a padded budget group whose
    short sequences share rows. Rows x width stays within ``max_tokens``."""
    groups: list[list[list[int]]] = []
    free: list[int] = []
    width = 0
    for i in order:
        n = lengths[i]
        r = next((r for r, room in enumerate(free) if room >= n), None) if groups else None
        if r is None and groups and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append([])
            free.append(width)
            r = len(free) - 1
        if r is None:
            width = n
            groups.append([[]])
            free = [width]
            r = 0
        groups[-1][r].append(i)
        free[r] -= n
    return groups


def _packed(batch: RLBatch, layout: list[list[int]], pad_id: int, pad_multiple: int,
            width: Optional[int]) -> MicroBatch:
    """Rows of ``layout`` (each a list of ``batch`` rows laid end to end), all as wide as the
    fullest row (or ``width``), padded to ``pad_multiple``."""
    members = [i for row in layout for i in row]
    view = batch.select(torch.tensor(members))
    lengths = view.lengths.tolist()
    width = max([width or 0] + [sum(int(batch.lengths[i]) for i in row) for row in layout])
    width += (-width) % pad_multiple
    shape = (len(layout), width)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.zeros(shape, dtype=torch.long)
    index = torch.zeros(view.tokens.shape, dtype=torch.long)
    j = segment = 0
    for r, row in enumerate(layout):
        start = 0
        for _ in row:
            n = lengths[j]
            tokens[r, start: start + n] = view.tokens[j, :n]
            targets[r, start: start + n] = view.targets[j, :n]
            positions[r, start: start + n] = torch.arange(n)
            segments[r, start: start + n] = segment
            index[j, :n] = r * width + torch.arange(start, start + n)
            j, segment, start = j + 1, segment + 1, start + n
        if start < width:  # the pad tail is a segment of its own: it attends only to itself
            positions[r, start:] = torch.arange(width - start)
            segments[r, start:] = segment
            segment += 1
    return MicroBatch(batch=view, rows=torch.tensor(members), tokens=tokens, targets=targets, positions=positions,
                      segments=segments, index=index)
