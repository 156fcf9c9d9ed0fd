"""The RL recipe: :class:`RLTrainer`, which ``megatron-alp train`` runs on every rank under torchrun.

One iteration (:meth:`RLTrainer.train_iteration`), as in the paper's setup: the batch source's next
scored batch (rollouts from the inference engine, n per prompt, with rewards) -> GRPO advantages ->
[old-policy and reference logprob passes, unperturbed; sigma calibration when due] -> k
policy-update mini-batches with the chosen loss (perturbed forward for ALP) -> weight sync to the
engines -> the iteration's metrics. Where the batch comes from (on-policy, generated ahead by up to
``trainer.max_staleness`` iterations, with dynamic sampling) is the batch source's business
(:mod:`megatron_alp.batches`), chosen once at setup.

Prompt sampling is deterministic and identical on all ranks; rollouts and rewards are produced once
and every rank gets them; each data-parallel rank trains on its share of every mini-batch, so an
optimizer step sees the same rows on any number of ranks. Randomness is re-derived from (seed,
iteration) at the start of every iteration, each rollout sample from (seed, iteration[,
dynamic-sampling round], prompt, sample) (``rollout.sampling.per_sample_seeds``) and ALP noise from
(seed, step, micro-batch, ranks), so a resumed run replays exactly what an uninterrupted run would
have done, and another parallel layout samples the same rollouts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_alp.batches.local_share import local_share
from megatron_alp.batches.scoring import Scorer
from megatron_alp.batches.sources import build_batch_source
from megatron_alp.config import Config, InputError
from megatron_alp.data.prompts import load_tokenizer, pad_id, training_sampler
from megatron_alp.diagnostics.figures import make_plots
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.plan.memory import check_fits_here
from megatron_alp.plan.phases import PHASES
from megatron_alp.plan.shape import RunShape
from megatron_alp.rewards import build_reward
from megatron_alp.rollout import DistributedRollout
from megatron_alp.rollout.placement import pin_trainer_cores
from megatron_alp.sync import WeightSync, weight_source
from megatron_alp.runtime.console import say
from megatron_alp.runtime.parallel import destroy_distributed, init_distributed
from megatron_alp.runtime.preemption import Preempted, StopRequests
from megatron_alp.runtime.run_log import read_metrics
from megatron_alp.runtime.seeding import derive_seed, seed_everything
from megatron_alp.tir.sandbox import SandboxExecutor
from megatron_alp.trainer.base_model import run_model_dir
from megatron_alp.trainer.checkpointer import Checkpointer
from megatron_alp.trainer.hang_watch import HangWatch, watching
from megatron_alp.trainer.metrics import dump_token_probs, iteration_metrics, run_summary, staleness_metrics
from megatron_alp.trainer.phases import PhaseRunner, kill_engine_at_rollout, memory_in_use, peak_memory, timed
from megatron_alp.trainer.run_dir import checkpoint_dir, claim_run_dir, open_run_logger, write_config
from megatron_alp.trainer.sigma_calibrator import SigmaCalibrator
from megatron_alp.trainer.validator import Validator
from megatron_alp.training.learner import Learner
from megatron_alp.training.policy_update import probe_mismatch
from megatron_alp.training.rl_batch import check_batch_layout


class RLTrainer:
    def __init__(self, cfg: Config):
        if not cfg.resolved:
            raise ValueError("RLTrainer takes a resolved config: megatron_alp.resolve.load_config or config_from_dict")
        self.cfg = cfg
        self.shape = RunShape.of(cfg)
        self.run_dir = Path(cfg.trainer.output_dir)
        self.iteration = 0
        self.logger = self.rollout = self.executor = self.batches = self._lock = None
        self._claimed = False
        self.phases = PhaseRunner()
        self.stop = StopRequests()  # the train command installs its signal handlers

    # ------------------------------------------------------------------------------- setup

    def claim_run_dir(self) -> None:
        """Inputs checked and the run directory taken (:func:`~megatron_alp.trainer.run_dir.claim_run_dir`),
        once; the ``train`` command calls it before any output goes to the run's log."""
        if not self._claimed:
            self._lock = claim_run_dir(self.cfg, int(os.environ.get("RANK", "0")))
            self._claimed = True

    def setup(self) -> None:
        cfg = self.cfg
        self.claim_run_dir()
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        self.rank = dist.get_rank()
        deadline = cfg.trainer.hang_deadline_s
        self.phases = PhaseRunner(
            ledger=self.run_dir / "phase_ledger" / f"rank_{self.rank}.jsonl" if cfg.trainer.phase_ledger else None,
            watch=HangWatch(deadline, self.run_dir, self.rank, list(PHASES)) if deadline else None)
        if self.rank == 0:
            write_config(self.run_dir, cfg)
        check_batch_layout(cfg.trainer, cfg.rollout.sampling.n, ps.get_data_parallel_world_size())
        check_fits_here(cfg, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
        # TIR: code runs on rank 0 only and its output is broadcast, so every rank's episodes agree; the
        # sandbox starts first so that a machine without full isolation refuses before any model loads
        self.executor = SandboxExecutor(cfg.tir.sandbox) if cfg.tir.enabled and self.rank == 0 else None
        self.model_dir = run_model_dir(cfg, self.phases, self.rank)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = pad_id(self.tokenizer)
        self.sampler = training_sampler(cfg, self.tokenizer, log=say if self.rank == 0 else None)
        self.reward_fn = build_reward(cfg.reward) if self.rank == 0 else None
        self.args = hf_to_megatron(load_hf_config(self.model_dir))
        self.checkpointer = Checkpointer(self.run_dir, self.shape, keep=cfg.trainer.keep_checkpoints,
                                         hf_dir=self.model_dir, lora=cfg.lora.enabled, phases=self.phases,
                                         rank=self.rank)
        resumed = self._build_learner()
        self._start_rollout()
        self.batches = build_batch_source(cfg, self.rollout, self.sampler, Scorer(cfg, self.reward_fn),
                                          tokenizer=self.tokenizer, executor=self.executor)
        if resumed is not None:
            self.checkpointer.restore(resumed, self.stateful)
        if resumed is not None or cfg.model.load is not None:
            self.phases.enter("weight_sync")
            self.weight_sync.sync(self.learner.module, version=self.iteration)
        self.calibrator = SigmaCalibrator(cfg, self.shape, self.learner, self.rollout, self.rank)
        self.validator = Validator(cfg, self.shape, self.phases, rollout=self.rollout, tokenizer=self.tokenizer,
                                   reward_fn=self.reward_fn, executor=self.executor, rank=self.rank)
        self.logger = open_run_logger(cfg, self.iteration) if self.rank == 0 else None

    def _build_learner(self) -> Optional[dict]:
        """The learner, from the run's newest intact checkpoint when resuming (then no initial policy
        weights are read): that checkpoint's component state, else None."""
        self.phases.enter("model_build")
        with watching(self.phases.watch):  # checksums, HF weights and a checkpoint, read from shared storage
            ckpt = self.checkpointer.latest() if self.cfg.trainer.resume else None
            self.learner = Learner.for_run(self.args, self.cfg, self.model_dir, self.pad_id, resuming=ckpt is not None,
                                           reference=self.shape.reference)
            state = self.checkpointer.load(ckpt, self.learner, self.cfg.perturbation.enabled) if ckpt else None
        if ckpt is not None and self.rank == 0:
            say(f"resumed from {ckpt} at iteration {state['iteration']}, step {state['step']}")
        self.phases.attach_learner(self.learner, self.cfg.rollout, on_cpu=self.cfg.trainer.phase_ledger)
        return state

    def _start_rollout(self) -> None:
        cfg = self.cfg
        t0 = time.time()
        self.phases.enter("engine_start")  # the engine claims its memory while Megatron's state is away
        self.rollout = DistributedRollout(cfg.rollout, str(self.model_dir), seed=cfg.trainer.seed,
                                          background=cfg.trainer.max_staleness > 0, lora=cfg.lora)
        self.weight_sync = WeightSync(self.rollout, weight_source(cfg.rollout, cfg.lora), scorer=probe_mismatch,
                                      phase=self.phases.within)
        self.phases.attach(rollout=self.rollout)
        if self.rank == 0:
            say(f"rollout engine: {self.rollout.replicas} {cfg.rollout.engine} replica(s) ready in {time.time() - t0:.0f} s")
        pin_trainer_cores(cfg.rollout)
        if cfg.trainer.max_staleness and cfg.tir.enabled and self.rollout.replica is not None:
            if self.executor is None:
                self.executor = SandboxExecutor(cfg.tir.sandbox)  # each replica leader runs its episodes' code
            self.executor.cores = self.rollout.engine_cores

    @property
    def stateful(self) -> list:
        """What a checkpoint saves besides the learner's tensors, and a resume restores."""
        return [self, self.learner, self.batches]

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "policy_version": self.rollout.version}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        if int(state.get("policy_version", self.iteration)) != self.iteration:
            raise InputError(f"checkpoint of iteration {self.iteration}: policy version {state['policy_version']} "
                             "does not match its iteration")

    # ------------------------------------------------------------------------------- loop

    def train(self) -> None:
        t = self.cfg.trainer
        if self.iteration >= t.iterations:
            if self.rank == 0:
                say(f"{self.run_dir} has finished its trainer.iterations={t.iterations}: nothing to train (raise "
                    "trainer.iterations to continue it, or choose another trainer.output_dir)")
            return
        started = time.time()
        if self.iteration == 0 and self.validator.due(0):  # where the validation curve starts
            base = self.validator.run()
            if self.rank == 0:
                self.logger.log(-1, {"step": 0, **base})
        while self.iteration < t.iterations:
            metrics = self.train_iteration()
            self.iteration += 1
            if self.validator.due(self.iteration):
                metrics.update(self.validator.run())
            if self.rank == 0:
                self.logger.log(self.iteration - 1, metrics)
            saved = self.checkpointer.due(self.iteration)
            if saved:
                self.save()
                self._plot()
            if self.iteration < t.iterations and self.stop.agreed():
                if not saved:
                    self.save()
                raise Preempted(self.stop.signal or "a preemption signal on another rank", self.iteration,
                                checkpoint_dir(self.run_dir, self.iteration))
        if self.rank == 0:
            lines, values = run_summary(read_metrics(self.run_dir)[0], time.time() - started, self.run_dir,
                                        self.cfg.eval.k, self.checkpointer.held_ahead)
            self.logger.summary(values)
            for line in lines:
                say(line)

    def train_iteration(self) -> dict:
        cfg, m, i = self.cfg, {}, self.iteration
        t_start = time.time()
        seed_everything(derive_seed(cfg.trainer.seed, i) % (2**31))
        self.phases.iteration = i
        self.phases.enter("rollout")
        kill_engine_at_rollout(self.rollout, i)
        groups = self.batches.next_batch(i, m)
        m.update(memory_in_use("rollout"))
        m.update(self.rollout.take_stats())
        m.update(staleness_metrics(groups.trajectories, i, cfg.rollout.partial_rollout))
        share = local_share(cfg, groups, self.rollout, self.pad_id, self.args.transformer["hidden_size"],
                            probe=self.calibrator.probe_due(i))
        m.update(share.balance)
        divergence = None  # sigma per layer (perturbation.calibration_mode: per_layer) needs the engine awake
        if share.probe is not None:
            self.phases.enter("layer_probe")
            with timed(m, "layer_probe"):
                divergence = self.calibrator.probe(share.probe)
        self.phases.enter("logprob")
        with peak_memory(m, "logprob"):
            self._logprob_passes(share.local, m, divergence)
        self.phases.enter("policy_update")
        with peak_memory(m, "update"), timed(m, "update"):
            step_stats, loss_metrics = self.learner.update(share.local, share.sizes)
        self.phases.enter("weight_sync")
        with peak_memory(m, "sync"), timed(m, "sync"):
            sync_stats = self.weight_sync.sync(self.learner.module, version=i + 1)
        m.update(self.phases.take_stats())
        m["timing/total_s"] = time.time() - t_start
        m.update({k: v for k, v in (sync_stats or {}).items() if isinstance(v, (int, float))})
        out = iteration_metrics(cfg, groups, share, step=self.learner.step, loss_metrics=loss_metrics,
                                step_stats=step_stats, data_state=self.batches.resume_state(),
                                learner_metrics=self.learner.metrics(), measured=m)
        dump_token_probs(cfg.trainer.token_prob_samples, share.local, self.run_dir, i)
        return out

    def _logprob_passes(self, local, m: dict, divergence: Optional[list[float]]) -> None:
        """The unperturbed old-policy pass (when the loss, the mismatch metrics or routing replay need
        it), sigma calibration when due (``divergence``: the layer probe's), and the reference pass."""
        calibrate = self.calibrator.due(self.iteration)
        with timed(m, "old_logprob"):
            if self.shape.old_pass or calibrate:
                self.learner.old_pass(local)
        if calibrate:
            with timed(m, "calibration"):
                m.update(self.calibrator.calibrate(local, self.iteration, divergence))
        with timed(m, "ref_logprob"):
            if self.learner.reference is not None:
                self.learner.reference_pass(local)

    def save(self) -> None:
        self.checkpointer.save(self.iteration, self.learner, self.stateful)

    def _plot(self) -> None:
        """Redraw the diagnostic figures (rank 0) whenever a checkpoint lands."""
        if self.rank != 0:
            return
        try:
            self.logger.figures(make_plots([self.run_dir], log=lambda msg: None))
        except Exception as err:  # a figure must never take the run down
            say(f"plot: skipped ({err})")

    def close(self) -> None:
        if self.phases.watch is not None:
            self.phases.watch.stop()
        if self.logger is not None:
            self.logger.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.executor is not None:
            self.executor.close()
        destroy_distributed()
