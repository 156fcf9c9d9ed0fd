"""One attempt of a vLLM rollout engine's ``generate``: the pending samples sent to vLLM's engine as
one request each, stepped until they finish, time out, or pause for a weight update (partial
rollouts), and turned into :class:`~megatron_alp.rollout.base.Completion` s.

Each sample is a request of its own, so a failed sample is retried alone; a seeded sample draws
from (seed, its prompt's key, sample). With partial rollouts the requests stream deltas (kept by
:class:`Partial`), and a waiting weight update stops the unfinished ones between decoding steps;
they continue after it from what they had generated, as a new span of their response. Under the
deterministic schedule the cut is fixed instead (``Interruption.cut_after``): each sample's first
span ends after that many tokens, whenever the update comes, and the rest waits for the next version.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.base import Completion, Interruption, RolloutError, SamplingParams, attempt_timeout
from megatron_alp.rollout.vllm.adapters import Adapters
from megatron_alp.rollout.weight_sync import is_finite
from megatron_alp.runtime.seeding import derive_seed


class EngineFailure(Exception):
    """The engine itself failed during a request (as opposed to a bad request)."""


def sampled_logprobs(c, tokens: list[int], i: int, j: int) -> list[float]:
    """The logprob of each sampled token of a vLLM CompletionOutput (or of its latest delta)."""
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise RolloutError(f"prompt {i} sample {j}: vLLM returned logprobs for "
                           f"{0 if c.logprobs is None else len(c.logprobs)} of {len(tokens)} tokens")
    return [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]


def vllm_sampling_params(params: SamplingParams, seed: Optional[int] = None, delta: bool = False):
    """vLLM's sampling parameters for one sample of ``params``."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
        n=1,  # one request per sample: a failed sample is retried alone
        seed=seed,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logprobs=0,  # the sampled token's logprob only
    )


class Partial:
    """Partial rollouts: each sample's tokens, logprobs and text so far (vLLM streams deltas), and
    the (first token, weight version) of each span, kept across the weight updates it outlives."""

    def __init__(self, version: int):
        self.version = version
        self._samples: dict[tuple[int, int], tuple[list, list, list, list]] = {}

    def _get(self, key):
        return self._samples.setdefault(key, ([], [], [], [(0, self.version)]))

    def extend(self, key, c) -> None:
        tokens, logprobs, texts, _ = self._get(key)
        new = list(c.token_ids)
        logprobs.extend(sampled_logprobs(c, new, *key))
        tokens.extend(new)
        texts.append(c.text)

    def tokens(self, i: int, j: int) -> list[int]:
        return list(self._get((i, j))[0])

    def text(self, key) -> str:
        return "".join(self._get(key)[2])

    def spans(self, i: int, j: int) -> int:
        """How many spans sample (i, j) has begun."""
        return len(self._get((i, j))[3])

    def new_span(self, i: int, j: int, version: int) -> int:
        """Start a span at the current end of sample (i, j); returns its number (1, 2, ...)."""
        spans = self._get((i, j))[3]
        spans.append((len(self._get((i, j))[0]), version))
        return len(spans) - 1

    def pop(self, key) -> tuple[list[int], list[float], list[tuple[int, int]]]:
        tokens, logprobs, _, spans = self._get(key)
        return tokens, logprobs, spans


class GenerationPass:
    """One pass over the pending (prompt, sample) pairs of a batch on ``llm``: :meth:`run` returns
    the finished samples and what went wrong with the rest. ``batch`` numbers the pass, so that its
    request ids are the engine's own; requests carry the adapter :attr:`Adapters.current` holds when
    they are sent (a partial rollout's update may change it)."""

    def __init__(self, llm, batch: int, prompts: list[list[int]], params: SamplingParams, keys: list[int], *,
                 cfg: RolloutConfig, adapters: Adapters, interruption: Optional[Interruption],
                 return_routing: bool):
        self.llm, self.engine = llm, llm.llm_engine
        self.batch, self.prompts, self.params, self.keys = batch, prompts, params, keys
        self.cfg, self.adapters, self.return_routing = cfg, adapters, return_routing
        self.interruption = interruption
        self.partial = Partial(interruption.version) if interruption is not None else None
        self.cut = interruption.cut_after() if interruption is not None else None  # tokens of a fixed first span
        self.ids: dict[str, tuple[int, int]] = {}
        self.got: dict[tuple[int, int], Completion] = {}
        self.cut_off: list[str] = []  # requests that ended at the fixed cut, to continue under the next version
        self.aborted = 0

    def run(self, pending: list[tuple[int, int]]) -> tuple[dict, Optional[str]]:
        """Raises :class:`EngineFailure` when the engine itself fails, :class:`RolloutError` for a
        request it refuses or an answer that cannot be right."""
        limit = attempt_timeout(self.cfg, len(pending), self.params.max_tokens)
        deadline = time.monotonic() + limit
        try:
            for i, j in pending:
                self._add(i, j)
            while self.engine.has_unfinished_requests() or self.cut_off:
                if time.monotonic() > deadline:
                    unfinished = self._stop() + self.cut_off
                    return self.got, (f"timed out after {limit:g} s with "
                                      f"{len(unfinished)} of {len(self.ids)} samples unfinished")
                if not self.engine.has_unfinished_requests():  # every sample finished or at the fixed cut
                    deadline += self._continue_after_update(self.cut_off)
                elif self.partial is not None and self.interruption.requested():
                    deadline += self._continue_after_update(self._stop())
                else:
                    self._step()
        except RolloutError:
            raise
        except Exception as err:
            raise EngineFailure(f"{type(err).__name__}: {err}") from err
        problem = f"{self.aborted} of {len(pending)} samples aborted by the engine" if self.aborted else None
        if not self.aborted and len(self.got) < len(pending):
            problem = f"{len(pending) - len(self.got)} of {len(pending)} samples never finished"
        return self.got, problem

    def _add(self, i: int, j: int, span: int = 0) -> None:
        from vllm.exceptions import VLLMClientError

        params, partial = self.params, self.partial
        done = partial.tokens(i, j) if partial is not None else []
        seed = None if params.seed is None else derive_seed(params.seed, self.keys[i], j, *([span] if span else []))
        budget = params.max_tokens - len(done)
        if self.cut is not None and span == 0:
            budget = min(budget, self.cut)
        vparams = vllm_sampling_params(replace(params, max_tokens=budget), seed=seed, delta=partial is not None)
        rid = f"b{self.batch}-p{i}-s{j}" + (f"-c{span}" if span else "")
        self.ids[rid] = (i, j)
        try:
            self.engine.add_request(rid, {"prompt_token_ids": list(self.prompts[i]) + done}, vparams,
                                    lora_request=self.adapters.current)
        except (ValueError, VLLMClientError) as err:  # a refused request: retrying cannot help
            self.engine.abort_request(list(self.ids))
            raise RolloutError(f"vLLM refused prompt {i}: {err}") from err

    def _stop(self) -> list[str]:
        """Abort the unfinished requests and step the engine until they are gone; their ids."""
        unfinished = [rid for rid, key in self.ids.items() if key not in self.got]
        self.engine.abort_request(unfinished)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return unfinished

    def _continue_after_update(self, stopped: list[str]) -> float:
        """Let the weight update run, and send each ``stopped`` request again from where it stopped,
        as a new span; the seconds the update took (they do not count against the attempt's time)."""
        t0 = time.monotonic()
        version = self.interruption.pause()  # the weights change here
        waited = time.monotonic() - t0
        for rid in stopped:
            i, j = self.ids.pop(rid)
            self._add(i, j, self.partial.new_span(i, j, version))
        self.cut_off = []
        return waited

    def _step(self) -> None:
        for out in self.engine.step():
            if out.request_id not in self.ids:
                continue
            key = self.ids[out.request_id]
            if self.partial is not None:
                self.partial.extend(key, out.outputs[0])
            if out.finished and self._at_cut(out, key):
                self.cut_off.append(out.request_id)  # continued under the next version
            elif out.finished:
                completion = self._completion(out, key)
                if completion is None:
                    self.aborted += 1
                else:
                    self.got[key] = completion

    def _at_cut(self, out, key) -> bool:
        """Whether a finished request ended at the fixed cut (its first span full, its response not)."""
        return (self.cut is not None and out.outputs[0].finish_reason == "length" and self.partial.spans(*key) == 1
                and len(self.partial.tokens(*key)) < self.params.max_tokens)

    def _completion(self, out, key) -> Optional[Completion]:
        i, j = key
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            return None  # aborted: retried
        if self.partial is not None:
            tokens, logprobs, spans = self.partial.pop(key)
            text = self.llm.get_tokenizer().decode(tokens, skip_special_tokens=True) if len(spans) > 1 else \
                self.partial.text(key)
        else:
            tokens = list(c.token_ids)
            logprobs = sampled_logprobs(c, tokens, i, j)
            spans, text = None, c.text
        if not is_finite(logprobs):
            raise RolloutError(f"prompt {i} sample {j}: non-finite logprob from vLLM (broken weights?)")
        routed = None
        if self.return_routing:
            routed = c.routed_experts
            fed = len(self.prompts[i]) + len(tokens) - 1
            if routed is None or len(routed) != fed:
                raise RolloutError(f"prompt {i} sample {j}: vLLM returned routed experts for "
                                   f"{0 if routed is None else len(routed)} of the {fed} tokens it fed through the "
                                   "model (moe.routing_replay=r3)")
        return Completion(prompt_ids=list(self.prompts[i]), response_ids=tokens, logprobs=logprobs,
                          finish_reason=c.finish_reason, text=text, stop_reason=c.stop_reason,
                          version_spans=spans if spans and len(spans) > 1 else None,
                          routed_experts=routed)
