"""The learner: the training side of RL as one object, which the trainer and the commands drive.

It owns the policy (wrapped for training, with ALP's perturbation sites and LoRA's adapters), its
optimizer and learning-rate scheduler, the reference (a frozen model, or the LoRA policy scored
with its adapters off) and the routing plan of the passes, and offers what an iteration does with
them: the unperturbed old-policy and reference logprob passes, sigma calibration, the layer inputs
the layer probe compares, and the update (one optimizer step per mini-batch). Its resume state is
the optimizer-step count. Nothing here knows of engines, schedules or run directories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from megatron_alp.config import Config, ParallelConfig, PerturbationConfig
from megatron_alp.models.families import MegatronModelArgs
from megatron_alp.models.lora import adapters_disabled
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.calibration import calibrate_sigma, probe_routing, site_layers
from megatron_alp.training.dist_checkpoint import load_checkpoint
from megatron_alp.training.layer_states import megatron_layer_states
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.optim import build_optimizer, learning_rates, wrap_for_training
from megatron_alp.training.perturbation import gather_sigma_stats
from megatron_alp.training.policy import Policy, build_policy, build_reference, load_weights
from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
from megatron_alp.training.rl_batch import RLBatch, mini_batches
from megatron_alp.training.routing_replay import RoutingPlan, routing_metrics
from megatron_alp.training.step_metrics import StepMetrics


class Learner:
    def __init__(self, cfg: Config, policy: Policy, reference, pad_id: int):
        self.cfg = cfg
        self.policy, self.optimizer, self.scheduler = policy.model, policy.optimizer, policy.scheduler
        self.module = policy.module  # the bare GPTModel: checkpoints, weight sync, sigma statistics
        self.reference = reference
        self.routing = RoutingPlan.for_config(cfg)
        self.pad_id = pad_id
        self.step = 0  # optimizer steps taken: the noise stream of the next update

    @classmethod
    def for_run(cls, args: MegatronModelArgs, cfg: Config, model_dir: str | Path, pad_id: int, *,
                resuming: bool, reference: Optional[str]) -> "Learner":
        """A training run's learner: the policy from ``model.load`` or ``model_dir`` (``resuming``: a
        checkpoint of the run replaces every weight next), and the reference the run shape names
        (:attr:`~megatron_alp.plan.shape.RunShape.reference`: ``model``, ``adapters_off`` or None)."""
        total_steps = cfg.trainer.iterations * cfg.trainer.updates_per_iteration
        policy = build_policy(args, cfg, model_dir, total_steps, resuming=resuming)
        frozen = None
        if reference == "adapters_off":
            frozen = policy.model
        elif reference == "model":
            frozen = build_reference(args, cfg, cfg.model.load or model_dir)
        return cls(cfg, policy, frozen, pad_id)

    @classmethod
    def from_weights(cls, args: MegatronModelArgs, cfg: Config, weights: str | Path, pad_id: int, *,
                     perturbation: PerturbationConfig, optimizer_state: bool, reference=None) -> "Learner":
        """One process, unsharded: ``weights`` (a checkpoint or an HF directory) with ``perturbation``'s
        sites, for one step at the peak learning rate. ``optimizer_state``: the checkpoint's moments,
        under this config's learning rates and decay; else a fresh optimizer (the weights are loaded
        first: a half-precision model's optimizer copies them into its fp32 main parameters)."""
        parallel = ParallelConfig(use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
        model = build_gpt_model(args, cfg.model, parallel, perturbation, moe=cfg.moe)
        if optimizer_state:
            wrapped = wrap_for_training(model, parallel)
            optimizer, scheduler = build_optimizer(wrapped, cfg.optimizer, perturbation, parallel, total_steps=1)
            settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            load_checkpoint(weights, wrapped, optimizer=optimizer, strict=True)
            for group, own in zip(optimizer.param_groups, settings):
                group.update(own)
        else:
            load_weights(model, weights, strict=True)
            wrapped = wrap_for_training(model, parallel)
            optimizer, scheduler = build_optimizer(wrapped, cfg.optimizer, perturbation, parallel, total_steps=1)
        return cls(cfg, Policy(wrapped, optimizer, scheduler), reference, pad_id)

    # ------------------------------------------------------------------------------- passes

    def _passes(self) -> dict:
        t = self.cfg.trainer
        return dict(batching=Batching.for_logprobs(t), temperature=self.cfg.rollout.sampling.temperature,
                    pad_id=self.pad_id, fused=t.fused_linear_logprobs)

    def logprobs(self, batch: RLBatch, perturb_step: Optional[int] = None) -> Optional[torch.Tensor]:
        """The policy's logprobs of ``batch`` (unperturbed, or with the noise of ``perturb_step``),
        without recording or replaying routing."""
        return compute_logprobs(self.policy, batch, perturb_step=perturb_step, **self._passes())

    def old_pass(self, batch: RLBatch) -> None:
        """``batch.old_logprobs``: the unperturbed policy before the update (and its routing, recorded)."""
        batch.old_logprobs = compute_logprobs(self.policy, batch, routing=self.routing.old, **self._passes())

    def reference_pass(self, batch: RLBatch) -> None:
        """``batch.ref_logprobs`` of the reference (the LoRA policy with its adapters off)."""
        with adapters_disabled(self.reference):
            batch.ref_logprobs = compute_logprobs(self.reference, batch, routing=self.routing.ref, **self._passes())

    def calibrate(self, batch: RLBatch, iteration: int, divergence: Optional[list[float]] = None) -> dict:
        """Sigma from ``batch``'s measured mismatch (needs ``old_logprobs``): the ``calibration/*`` metrics."""
        return calibrate_sigma(self.policy, batch, self.cfg.perturbation, iteration=iteration,
                               replay=self.routing.update.replay, divergence=divergence, **self._passes())

    def layer_inputs(self, sequences: list[list[int]], batch: RLBatch,
                     engine: Optional[list[dict]] = None) -> list[dict]:
        """This model's input of every decoder layer for ``sequences`` (rows of ``batch``, cut short), with
        the update pass's routing replay: what the layer probe compares with the engine's. ``engine``:
        the engine's inputs (``calibration_mode: per_layer_added``), which the perturbed layers run on
        instead of their own, so each site's input is what this model makes of the engine's at the site before."""
        fed = [e["input"] for e in engine] if engine is not None else None
        return megatron_layer_states(self.policy, sequences, kinds=("input",), fed=fed, at=tuple(self.site_layers),
                                     routing=probe_routing(batch, sequences, self.routing.update.replay))

    @property
    def site_layers(self) -> list[int]:
        return site_layers(self.policy)

    # ------------------------------------------------------------------------------- update

    def update(self, batch: RLBatch, sizes: list[int]) -> tuple[list[dict], list[dict]]:
        """One optimizer step per mini-batch of ``sizes`` rows; each step's stats and its loss metrics
        (reduced over data-parallel ranks on the last pipeline stage, {} elsewhere)."""
        step_stats, loss_metrics = [], []
        for mini in mini_batches(batch, sizes):
            metrics = StepMetrics()
            step_stats.append(self.step_on(mini, metrics))
            self.scheduler.step(1)
            self.step += 1
            loss_metrics.append(metrics.reduce(ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else {})
        return step_stats, loss_metrics

    def step_on(self, batch: RLBatch, metrics: StepMetrics) -> dict:
        """One optimizer step on ``batch`` with the configured loss (perturbed forward for ALP)."""
        t = self.cfg.trainer
        return train_mini_batch(self.policy, self.optimizer, batch, loss_cfg=self.cfg.loss, step=self.step,
                                batching=Batching.for_update(t), temperature=self.cfg.rollout.sampling.temperature,
                                pad_id=self.pad_id, metrics=metrics, fused=t.fused_linear_logprobs,
                                routing=self.routing.update)

    def metrics(self) -> dict:
        """Learning rates, sigmas and routing statistics (collective: every rank calls it)."""
        return {**learning_rates(self.optimizer), **gather_sigma_stats(self.module), **routing_metrics(self.policy)}

    def sigma_stats(self) -> dict:
        return gather_sigma_stats(self.module)

    # ------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
