"""The run shape: what a run does, worked out once from its resolved config.

Which models exist (the policy always; a reference model, or the LoRA policy scored with its
adapters off, when ``loss.kl_coef > 0``), which logprob passes an iteration runs, which phases of
the table (:data:`~megatron_alp.plan.phases.PHASES`) the config runs at all, and when the
scheduled ones are due: sigma calibration and the layer probe, validation and checkpoints. The
trainer's components ask it (``due``), ``megatron-alp plan`` prints it and counts the phases it
runs, and ``mismatch`` calibrates by the same rule; nothing else decides any of this.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_alp.algorithms.policy_loss import needs_old_logprobs, needs_ref_logprobs
from megatron_alp.config import Config
from megatron_alp.plan.phases import PHASES, probes_layers
from megatron_alp.training.routing_replay import RoutingPlan

# what may be due in an iteration besides its fixed phases (rollout, logprob, policy_update, weight_sync)
EVENTS = ("calibration", "layer_probe", "validation", "checkpoint_save")


@dataclasses.dataclass(frozen=True)
class RunShape:
    iterations: int
    reference: Optional[str]  # "model" (a frozen copy), "adapters_off" (the LoRA policy without adapters), None
    old_pass: bool  # the unperturbed old-policy pass: the loss's ratio, mismatch metrics or routing replay need it
    calibrate_every: Optional[int]  # None: sigma is not calibrated; 0: at the first iteration only
    layer_probe: bool  # each calibration sizes sigma by the layers' input divergence first
    eval_interval: int
    validate_base: bool
    save_interval: int
    skipped: dict[str, str]  # phase -> why this config never runs it

    @classmethod
    def of(cls, cfg: Config) -> "RunShape":
        if not cfg.resolved:
            raise ValueError("RunShape takes a resolved config: megatron_alp.resolve.load_config or config_from_dict")
        pert, t = cfg.perturbation, cfg.trainer
        reference = ("adapters_off" if cfg.lora.enabled else "model") if needs_ref_logprobs(cfg.loss) else None
        routing = RoutingPlan.for_config(cfg)
        return cls(
            iterations=t.iterations, reference=reference,
            old_pass=needs_old_logprobs(cfg.loss.name) or t.mismatch_metrics or routing.needs_old_pass,
            calibrate_every=pert.calibrate_every if pert.init_std == "auto" else None,
            layer_probe=probes_layers(cfg) is None, eval_interval=t.eval_interval, validate_base=t.validate_base,
            save_interval=t.save_interval,
            skipped={name: why for name, spec in PHASES.items() if (why := spec.runs(cfg)) is not None})

    def calibrates(self, iteration: int) -> bool:
        """Iteration ``iteration`` (0-based) starts its logprob phase with a sigma calibration: the
        first, and every ``perturbation.calibrate_every``."""
        if self.calibrate_every is None:
            return False
        return iteration == 0 or bool(self.calibrate_every and iteration % self.calibrate_every == 0)

    def probes_layers(self, iteration: int) -> bool:
        return self.layer_probe and self.calibrates(iteration)

    def validates(self, done: int) -> bool:
        """Validation after ``done`` iterations: every ``trainer.eval_interval`` and after the last;
        ``done`` 0 is the base model's (``trainer.validate_base``)."""
        if not self.eval_interval:
            return False
        if done == 0:
            return self.validate_base
        return done % self.eval_interval == 0 or done == self.iterations

    def saves(self, done: int) -> bool:
        """A checkpoint after ``done`` iterations: every ``trainer.save_interval`` and after the last."""
        return done > 0 and (done % self.save_interval == 0 or done == self.iterations)

    def due(self, iteration: int) -> frozenset[str]:
        """The :data:`EVENTS` of iteration ``iteration`` (0-based): calibration and the layer probe
        before its update, validation and a checkpoint after it."""
        return frozenset(name for name, on in (
            ("calibration", self.calibrates(iteration)), ("layer_probe", self.probes_layers(iteration)),
            ("validation", self.validates(iteration + 1)), ("checkpoint_save", self.saves(iteration + 1))) if on)

    def describe(self) -> list[str]:
        """The shape as lines for ``megatron-alp plan``."""
        every = ("never" if self.calibrate_every is None else "at the first iteration" if not self.calibrate_every
                 else f"at iteration 0 and every {self.calibrate_every}")
        lines = [
            f"models: policy{'' if self.reference is None else ', reference (' + self.reference + ')'}",
            "passes: " + ", ".join(p for p, on in (("old-policy logprobs", self.old_pass),
                                                 ("reference logprobs", self.reference is not None),
                                                 ("policy update", True)) if on),
            f"sigma calibration: {every}{' (per layer, after a layer probe)' if self.layer_probe else ''}",
            f"checkpoints: every {self.save_interval} iterations and after the last ({self.iterations})",
            "validation: " + (f"every {self.eval_interval} iterations and after the last"
                              + (", and of the base model" if self.validate_base else "") if self.eval_interval
                              else "never"),
        ]
        lines += [f"phase {name} does not run: {why}" for name, why in self.skipped.items()]
        return lines
