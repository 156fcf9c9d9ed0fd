"""``perturbation.init_std: auto`` in a run: when the run shape says, sigma is calibrated on the
iteration's batch after the old-policy pass (:meth:`Learner.calibrate
<megatron_alp.training.learner.Learner.calibrate>`), and with ``calibration_mode: per_layer`` a
layer probe first sizes each layer's noise: the trainer asks the engine for its layer inputs of the
probe sequences (engine awake: the ``layer_probe`` phase), the learner computes its own, and a pure
function compares them on the rank that holds the engine's, which every rank then receives. With
``per_layer_added`` every rank first receives the engine's inputs (``[layers, tokens, hidden]``
float32 per probe sequence), since each runs its share of the forward that starts the perturbed
layers from them."""

from __future__ import annotations

from megatron_alp.config import Config
from megatron_alp.plan.shape import RunShape
from megatron_alp.runtime.console import say
from megatron_alp.training.calibration import batch_probe, calibration_line, input_divergence
from megatron_alp.training.learner import Learner
from megatron_alp.training.rl_batch import RLBatch


class SigmaCalibrator:
    def __init__(self, cfg: Config, shape: RunShape, learner: Learner, rollout, rank: int):
        self.cfg = cfg.perturbation
        self.added = cfg.perturbation.calibration_mode == "per_layer_added"
        self.shape, self.learner, self.rollout, self.rank = shape, learner, rollout, rank

    def due(self, iteration: int) -> bool:
        return self.shape.calibrates(iteration)

    def probe_due(self, iteration: int) -> bool:
        return self.shape.probes_layers(iteration)

    def probe(self, batch: RLBatch) -> list[float]:
        """Collective: per perturbed site, the divergence of its input between engine and trainer."""
        sequences = batch_probe(batch)
        engine = self.rollout.layer_states(sequences, kinds=("input",))
        if self.added:
            engine = self.rollout.broadcast(engine, src=self.rollout.prober)
        train = self.learner.layer_inputs(sequences, batch, engine if self.added else None)
        local = input_divergence(engine, train, self.learner.site_layers) if engine is not None else None
        return self.rollout.broadcast(local, src=self.rollout.prober)

    def calibrate(self, batch: RLBatch, iteration: int, divergence) -> dict:
        """Collective: sigma set from ``batch``; the ``calibration/*`` metrics, and one line on rank 0."""
        metrics = self.learner.calibrate(batch, iteration, divergence)
        sigmas = self.learner.sigma_stats()
        if self.rank == 0:
            say(calibration_line(metrics, sigmas, self.cfg, iteration))
        return metrics
