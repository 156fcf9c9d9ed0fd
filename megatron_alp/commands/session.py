"""A command's session: what ``mismatch``, ``intervene`` and ``eval`` work with, made once and torn
down on exit, so that each command reads as its own job and none assembles the library its own way.

It holds the resolved config, the seed and the model directory; gives the tokenizer, the prompt
data sets and the Megatron model arguments on first use; runs torch.distributed and Megatron's
parallel state for one unsharded process (TP = PP = 1) when the command scores with Megatron; and
starts the rollout engine on first use and shuts it down on exit (or when the command says it is
done with it, to give its memory back before scoring). The models are the library's: a frozen
scorer (the reference, or the config's ALP sites for a calibration) and the
:class:`~megatron_alp.training.learner.Learner` of an update.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Optional

from megatron_alp.commands.context import one_process
from megatron_alp.config import Config, ParallelConfig, PerturbationConfig, RolloutConfig
from megatron_alp.data.prompts import PromptDataset, load_tokenizer, pad_id
from megatron_alp.models.families import MegatronModelArgs, hf_to_megatron, load_hf_config
from megatron_alp.rollout import DistributedRollout, build_engine
from megatron_alp.sync import FullWeights, WeightSync
from megatron_alp.training.learner import Learner
from megatron_alp.training.policy import build_reference
from megatron_alp.training.policy_update import probe_mismatch


class Session:
    def __init__(self, cfg: Config, model_dir: str | Path, *, seed: int, megatron: bool = True):
        """``megatron``: the command builds Megatron models (then torch.distributed runs for the
        session's one process, and engines are :class:`DistributedRollout` objects that can take
        Megatron's weights); else a plain engine (``eval``)."""
        self.cfg, self.model_dir, self.seed, self.megatron = cfg, str(model_dir), seed, megatron
        self._stack = contextlib.ExitStack()
        self._engine = self._sync = None

    def __enter__(self) -> "Session":
        if self.megatron:
            self._stack.enter_context(one_process(self.seed))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close_engine()
        finally:
            self._stack.close()

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.model_dir)

    @property
    def pad_id(self) -> int:
        return pad_id(self.tokenizer)

    @functools.cached_property
    def hf_args(self) -> MegatronModelArgs:
        return hf_to_megatron(load_hf_config(self.model_dir))

    def prompts(self, split: str, head: Optional[int] = None) -> PromptDataset:
        """The config's ``split`` prompts (``data.train_files`` or ``data.val_files``), the first ``head``."""
        s = self.cfg.rollout.sampling
        return PromptDataset.from_config(self.cfg.data, self.tokenizer, s.max_prompt_length, split=split).head(head)

    def engine(self, rollout: Optional[RolloutConfig] = None):
        """The rollout engine (``rollout``: other settings than the config's), started on first use."""
        if self._engine is None:
            rollout = rollout or self.cfg.rollout
            if self.megatron:
                self._engine = DistributedRollout(rollout, self.model_dir, seed=self.seed)
                self._sync = WeightSync(self._engine, FullWeights(rollout.sync_bucket_mb << 20), scorer=probe_mismatch)
            else:
                self._engine = build_engine(rollout, self.model_dir, self.seed)
        return self._engine

    def sync_weights(self, model) -> dict:
        """``model``'s weights into the started engine (a :class:`DistributedRollout`); ``sync/*`` statistics."""
        return self._sync.sync(model)

    def close_engine(self) -> None:
        if self._engine is not None:
            engine, self._engine, self._sync = self._engine, None, None
            engine.shutdown()

    def scorer(self, source: str | Path, perturbation: Optional[PerturbationConfig] = None):
        """A frozen model of ``source``'s weights, unsharded: the reference, or with ``perturbation``'s
        sites for a calibration's perturbed passes (the plain passes stay unperturbed)."""
        return build_reference(self.hf_args, self.cfg, source, parallel=ParallelConfig(), perturbation=perturbation)

    def learner(self, cfg: Config, weights: str | Path, *, perturbation: PerturbationConfig, optimizer_state: bool,
                reference=None) -> Learner:
        """``cfg``'s learner from ``weights``, for one step (see :meth:`Learner.from_weights`)."""
        return Learner.from_weights(self.hf_args, cfg, weights, self.pad_id, perturbation=perturbation,
                                    optimizer_state=optimizer_state, reference=reference)
