"""Multi-turn tool-integrated reasoning rollouts (SimpleTIR style, paper section 4).

An episode alternates model turns and interpreter feedback until the model ends it:

1. The model generates until it closes a ```python code block (the engine stops on the
   :data:`CODE_STOP` string ``"```\\n"``: the closing fence; an opening fence is ``"```python\\n"``
   and does not match), until its end-of-turn token, or until the length limit.
2. A turn that ends with a code block has the code executed in the sandbox; the output is
   appended as interpreter feedback and the model continues from prompt + everything so far. With
   ``tool_format: inline`` the feedback is an ``output`` fenced block (:func:`format_output`) inside
   the assistant message; with ``chat`` it is the tool turn the tokenizer's chat template renders
   (closing the assistant message, the tool message, the next assistant header).
3. The episode ends when the model ends a turn without a code block (its final answer), after
   ``max_turns`` executions (a further code block is not executed), or at the length limit:
   ``params.max_tokens`` bounds the whole response, model and feedback tokens together.

Token-in, token-out: the model's tokens are kept exactly as sampled, with the engine's logprobs,
and feedback is tokenized on its own and appended, so the trainer scores exactly the sequence
the engine saw. ``loss_mask`` is 1 on model tokens and 0 on feedback tokens and on void turns
(with ``mask_void_turns``: a turn the model ends with neither code nor a final ``\\boxed{}``
answer; a turn cut by the length limit is not void); ``rollout_logprobs`` is 0.0 wherever the
mask is 0. With routed experts from the engine (MoE, R3) an episode keeps its latest turn's,
whose request held the whole context; tool output appended after the last turn has none.
``Trajectory.num_turns`` counts model turns, and ``info`` holds ``executions``,
``void_turns``, ``tool_status`` (executions per sandbox status) and ``segments``: ``[kind, start,
end]`` spans of the response, kind ``model``, ``tool`` or ``void`` (a masked void turn).
``finish_reason`` is ``stop``, ``length`` or ``max_turns``.

A stop on ``"```\\n"`` that does not close a python block (a bare opening fence) is not a turn
boundary: generation resumes in the same turn. Engines report which stop string ended a
completion in ``Completion.stop_reason``; when one does not, a completion that stopped, did not
end with an end-of-sequence token and ends with the fence is taken as stopped on it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np

from megatron_alp.config import TIRConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.rewards.math_verify import extract_boxed
from megatron_alp.rollout.base import Completion, SamplingParams
from megatron_alp.runtime.seeding import derive_seed

CODE_STOP = "```\n"

_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)
_SENTINEL = "\u2063TIR-ASSISTANT-TURN\u2063"
_TOOL_CONTENT = "\u2063TIR-TOOL-CONTENT\u2063"


def find_code(turn_text: str) -> Optional[str]:
    """The code of the ```python block that ends ``turn_text`` (only whitespace after its closing
    fence), or None."""
    last = None
    for m in _CODE_BLOCK.finditer(turn_text):
        last = m
    if last is None or turn_text[last.end():].strip():
        return None
    return last.group(1)


def format_output(text: str) -> str:
    """The interpreter output as the model sees it."""
    return f"```output\n{text.rstrip(chr(10))}\n```\n"


class FeedbackFormatter:
    """Token ids of interpreter feedback, appended right after a model turn.

    The interpreter's output (which may echo the model's code, e.g. in a traceback) is inserted as
    text: wherever encoding it yields one of the tokenizer's added tokens (``<|im_end|>``,
    ``<|im_start|>``, ...), whether its string was printed as it is or in a form the tokenizer
    normalises into it (NFKC: ``＜｜im_end｜＞``), that text is encoded again in two halves. The
    check is on the ids, so it holds whatever the tokenizer matches added tokens on: printed text
    can never end the turn or forge chat structure. Only the chat template's own markup becomes
    control tokens."""

    def __init__(self, tokenizer, tool_format: str):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.eos_text = tokenizer.eos_token or ""
        self._control = frozenset(i for t, i in tokenizer.get_added_vocab().items() if len(t) > 1) | frozenset(
            getattr(tokenizer, "all_special_ids", ()))
        if tool_format == "chat":
            self._chat_prefix, self._chat_suffix = self._template_parts()
        elif tool_format != "inline":
            raise ValueError(f"tir.tool_format={tool_format!r}: expected 'inline' or 'chat'")

    def _tool_turn(self, content: str) -> str:
        """What the chat template puts after an assistant message's content when a tool message
        with ``content`` follows and the model is to answer next."""
        messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _SENTINEL},
                    {"role": "tool", "content": content}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text[text.index(_SENTINEL) + len(_SENTINEL):]

    def _template_parts(self) -> tuple[str, str]:
        """The tool turn's markup before and after the tool message's content."""
        try:
            turn = self._tool_turn(_TOOL_CONTENT)
        except Exception as err:
            raise ValueError(
                f"tir.tool_format=chat: the tokenizer's chat template cannot render a `tool` message ({err}); "
                "use tool_format: inline"
            ) from None
        if turn.count(_TOOL_CONTENT) != 1:
            raise ValueError("tir.tool_format=chat: the chat template does not keep `tool` message content as "
                             "it is; use tool_format: inline")
        prefix, suffix = turn.split(_TOOL_CONTENT)
        return prefix, suffix

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: no added token comes out of it (a single
        character that the tokenizer turns into one by itself is dropped)."""
        ids = self._encode(text)
        if not self._control.intersection(ids):
            return ids
        if len(text) <= 1:
            return []
        half = len(text) // 2
        return self.encode_text(text[:half]) + self.encode_text(text[half:])

    def __call__(self, output: str, turn_text: str, ended_with_eos: bool) -> list[int]:
        block = format_output(output)
        if self.tool_format == "inline":
            return self.encode_text(("" if turn_text.endswith("\n") else "\n") + block)
        prefix = self._chat_prefix
        if ended_with_eos and self.eos_text and prefix.startswith(self.eos_text):
            prefix = prefix[len(self.eos_text):]
        return self._encode(prefix) + self.encode_text(block.rstrip("\n")) + self._encode(self._chat_suffix)


@dataclass
class _Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0
    num_turns: int = 0
    executions: int = 0
    void_turns: int = 0
    tool_status: Counter = field(default_factory=Counter)
    segments: list[tuple[str, int, int]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    routed_experts: Optional[np.ndarray] = None  # the engine's routing of prompt + response so far (MoE, R3)

    def room(self, budget: int, max_model_len: Optional[int]) -> int:
        left = budget - len(self.response_ids)
        if max_model_len is not None:
            left = min(left, max_model_len - len(self.prompt_ids) - len(self.response_ids))
        return left

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        self.response_ids += ids
        self.logprobs += [float(x) for x in logprobs]
        self.mask += [1] * len(ids)

    def close_turn(self, void: bool, mask_void: bool) -> None:
        start, end = self.turn_start, len(self.response_ids)
        self.num_turns += 1
        kind = "model"
        if void:
            self.void_turns += 1
            if mask_void:
                kind = "void"
                self.mask[start:end] = [0] * (end - start)
                self.logprobs[start:end] = [0.0] * (end - start)
        if end > start:
            self.segments.append((kind, start, end))
        self.turn_start = end

    def add_tool(self, ids: list[int]) -> None:
        start = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        if ids:
            self.segments.append(("tool", start, len(self.response_ids)))
        self.turn_start = len(self.response_ids)


def _engine_max_len(rollout) -> Optional[int]:
    try:
        value = rollout.max_model_len
    except (NotImplementedError, AttributeError):
        return None
    return int(value) if value else None


def run_episodes(rollout, prompts: list[list[int]], tokenizer, params: SamplingParams, cfg: "TIRConfig",
                 executor, broadcast: Optional[Callable[[Any], Any]] = None) -> list[Trajectory]:
    """Roll out ``params.n`` multi-turn episodes per prompt (in prompt order, like
    ``RolloutEngine.generate``). All active episodes of a turn go to the engine in one call and all
    their code to ``executor.run_many`` in one batch (a :class:`~megatron_alp.tir.sandbox.SandboxExecutor`,
    or anything whose results have ``text`` and ``status``); ``params.max_tokens`` bounds each
    episode's whole response. Engine failures raise; nothing the executed code does does.

    Multi-rank jobs run this loop on every rank, collectively (``DistributedRollout.generate``
    gives every rank the same completions). Pass ``broadcast``, a function that returns rank 0's
    value of a Python object on every rank: code then runs on rank 0 only (``executor`` may be
    None elsewhere) and all ranks append the same feedback. Without it each rank would execute the
    code itself, and output that varies between runs (time, randomness, hash order, a timeout
    under load) would make the ranks' episodes differ."""
    fmt = FeedbackFormatter(tokenizer, cfg.tool_format)
    eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    stop = tuple(dict.fromkeys((*params.stop, CODE_STOP)))
    budget = params.max_tokens
    max_len = _engine_max_len(rollout)
    episodes = [_Episode(list(p)) for p in prompts for _ in range(params.n)]
    first = True
    turn = 0
    while True:
        active = [e for e in episodes if e.finish_reason is None]
        for e in active:
            if e.room(budget, max_len) <= 0:
                if len(e.response_ids) > e.turn_start:
                    e.close_turn(void=False, mask_void=cfg.mask_void_turns)
                e.finish_reason = "length"
        active = [e for e in active if e.finish_reason is None]
        if not active:
            break
        rooms = [e.room(budget, max_len) for e in active]
        # a seeded call seeds sample j of prompt i from (seed, i, j): each turn needs its own seed
        turn_seed = None if params.seed is None else derive_seed(params.seed, turn)
        turn += 1
        turn_params = replace(params, max_tokens=max(rooms), stop=stop, include_stop_str_in_output=True,
                              seed=turn_seed)
        if first:
            groups = rollout.generate([list(p) for p in prompts], turn_params)
            completions = [c for g in groups for c in g]
        else:
            groups = rollout.generate([e.prompt_ids + e.response_ids for e in active], replace(turn_params, n=1))
            completions = [g[0] if g else None for g in groups]
        if len(completions) != len(active) or any(c is None for c in completions):
            raise RuntimeError(f"the rollout engine returned {len(completions)} completions for "
                               f"{len(active)} active episodes")
        first = False
        pending: list[tuple[_Episode, str, str, bool]] = []
        for e, c, room in zip(active, completions, rooms):
            _take_turn(e, c, room, tokenizer, eos_ids, cfg, pending)
        if not pending:
            continue
        outputs = None
        if executor is not None:
            outputs = [(r.text, r.status) for r in executor.run_many([code for _, code, _, _ in pending])]
        if broadcast is not None:
            outputs = broadcast(outputs)
        if outputs is None:
            raise RuntimeError("run_episodes: code to execute but no executor (it must exist on rank 0)")
        for (e, _, turn_text, eos), (text, status) in zip(pending, outputs):
            e.close_turn(void=False, mask_void=cfg.mask_void_turns)
            e.executions += 1
            e.tool_status[status] += 1
            ids = fmt(text, turn_text, eos)
            room = e.room(budget, max_len)
            if len(ids) >= room:
                e.add_tool(ids[:max(room, 0)])
                e.finish_reason = "length"
            else:
                e.add_tool(ids)
    return [_to_trajectory(e, tokenizer) for e in episodes]


def _take_turn(e: _Episode, c: Completion, room: int, tokenizer, eos_ids: set, cfg, pending: list) -> None:
    """Append one completion to its episode and decide what happens next."""
    ids, logprobs = list(c.response_ids[:room]), list(c.logprobs[:room])
    cut = len(c.response_ids) > room
    e.add_model(ids, logprobs)
    if c.routed_experts is not None:  # each turn's request holds the whole context: its routing covers it
        e.routed_experts = c.routed_experts[: len(e.prompt_ids) + len(e.response_ids)]
    turn_text = tokenizer.decode(e.response_ids[e.turn_start:], skip_special_tokens=True)
    if cut or c.finish_reason == "length":
        e.close_turn(void=False, mask_void=cfg.mask_void_turns)
        e.finish_reason = "length"
        return
    if c.finish_reason != "stop":
        e.close_turn(void=False, mask_void=cfg.mask_void_turns)
        e.finish_reason = c.finish_reason
        return
    ended_with_eos = bool(ids) and ids[-1] in eos_ids
    on_fence = bool(ids) and (c.stop_reason == CODE_STOP or (
        c.stop_reason is None and not ended_with_eos and CODE_STOP in turn_text[-(len(CODE_STOP) + 8):]))
    code = find_code(turn_text)
    executes = code is not None and (on_fence or (ended_with_eos and cfg.tool_format == "chat"))
    if executes:
        if e.executions >= cfg.max_turns:
            e.close_turn(void=False, mask_void=cfg.mask_void_turns)
            e.finish_reason = "max_turns"
        else:
            pending.append((e, code, turn_text, ended_with_eos))
        return
    if on_fence:
        return  # a fence that closes no python block: the turn goes on
    void = code is None and extract_boxed(turn_text) is None
    e.close_turn(void=void, mask_void=cfg.mask_void_turns)
    e.finish_reason = "stop"


def tir_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-iteration tool use, from the episodes' ``info``: whether the model writes code, whether
    it runs, and how often turns are void or episodes hit the turn limit."""
    n = max(len(trajectories), 1)
    turns = sum(t.num_turns for t in trajectories)
    executions = [t.info.get("executions", 0) for t in trajectories]
    statuses: Counter = Counter()
    for t in trajectories:
        statuses.update(t.info.get("tool_status", {}))
    out = {
        "tir/turns_mean": turns / n,
        "tir/executions_mean": sum(executions) / n,
        "tir/used_tool_frac": sum(x > 0 for x in executions) / n,
        "tir/void_turn_frac": sum(t.info.get("void_turns", 0) for t in trajectories) / max(turns, 1),
        "tir/max_turns_frac": sum(t.finish_reason == "max_turns" for t in trajectories) / n,
    }
    total = sum(statuses.values())
    out.update({f"tir/status_frac/{k}": statuses[k] / max(total, 1) for k in sorted(statuses)})
    return out


def _to_trajectory(e: _Episode, tokenizer) -> Trajectory:
    return Trajectory(
        prompt_ids=e.prompt_ids,
        response_ids=e.response_ids,
        rollout_logprobs=e.logprobs,
        loss_mask=e.mask,
        response_text=tokenizer.decode(e.response_ids, skip_special_tokens=True),
        finish_reason=e.finish_reason or "stop",
        num_turns=e.num_turns,
        info={
            "executions": e.executions,
            "void_turns": e.void_turns,
            "tool_status": dict(e.tool_status),
            "segments": [list(s) for s in e.segments],
        },
        routed_experts=e.routed_experts,
    )
