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

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_alp.algorithms.policy_loss import needs_old_logprobs, needs_ref_logprobs
from megatron_alp.batches.evaluation import Validation
from megatron_alp.batches.local_share import local_share
from megatron_alp.batches.sampling import VALIDATION_STREAM, sample_seed
from megatron_alp.batches.scoring import Scorer
from megatron_alp.batches.sources import build_batch_source
from megatron_alp.config import Config, InputError
from megatron_alp.data.prompts import PromptDataset, PromptSampler, load_tokenizer, pad_id
from megatron_alp.diagnostics.figures import make_plots
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.lora import adapters_disabled
from megatron_alp.rewards import build_reward
from megatron_alp.rollout import DistributedRollout
from megatron_alp.rollout.placement import pin_trainer_cores
from megatron_alp.runtime.console import say
from megatron_alp.runtime.parallel import destroy_distributed, init_distributed
from megatron_alp.runtime.platform import has_gpu
from megatron_alp.runtime.preemption import Preempted, StopRequests
from megatron_alp.runtime.run_log import read_metrics
from megatron_alp.runtime.seeding import derive_seed, seed_everything
from megatron_alp.tir.sandbox import SandboxExecutor
from megatron_alp.trainer.base_model import base_model_dir, check_model_dir, make_base_model
from megatron_alp.trainer.hang_watch import HangWatch, watching
from megatron_alp.trainer.inputs import check_run_inputs
from megatron_alp.plan.memory import check_fits
from megatron_alp.trainer.metrics import (
    batch_metrics,
    data_metrics,
    dump_token_probs,
    mean_dicts,
    run_summary,
    staleness_metrics,
    throughput_metrics,
    update_metrics,
)
from megatron_alp.trainer.phases import PHASES, PhaseRunner, kill_engine_at_rollout, memory_in_use, peak_memory, timed
from megatron_alp.trainer.run_dir import (
    checkpoint_dir,
    claim_fresh,
    kill_during_save,
    lock_run_dir,
    open_run_logger,
    prune_checkpoints,
    write_config,
)
from megatron_alp.training.calibration import (
    calibrate_sigma,
    calibration_due,
    calibration_line,
    layer_input_divergence,
    layer_probe_due,
)
from megatron_alp.training.dist_checkpoint import (
    current_layout,
    intact_checkpoint,
    load_checkpoint,
    read_metadata,
    relayout_line,
    save_checkpoint,
)
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.offload import TrainingStateOffloader, offloader_for
from megatron_alp.training.optim import learning_rates
from megatron_alp.training.perturbation import gather_sigma_stats
from megatron_alp.training.policy import build_policy, build_reference
from megatron_alp.training.policy_update import (
    compute_logprobs,
    from_last_stage,
    model_chunks,
    probe_mismatch,
    train_mini_batch,
)
from megatron_alp.training.rl_batch import check_batch_layout, mini_batches
from megatron_alp.training.routing_replay import RoutingPlan, routing_metrics
from megatron_alp.training.step_metrics import StepMetrics


class RLTrainer:
    def __init__(self, cfg: Config):
        if not cfg.resolved:
            raise ValueError("RLTrainer takes a resolved config: megatron_alp.resolve.load_config or config_from_dict")
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.output_dir)
        self.iteration = self.step = 0
        self.logger = self.rollout = self.executor = self.batches = self._validation = self._lock = None
        self._claimed = False
        self.phases = PhaseRunner()
        self.stop = StopRequests()  # the train command installs its signal handlers

    # ------------------------------------------------------------------------------- setup

    def claim_run_dir(self) -> None:
        """Check every input (nothing is created when one is wrong), then, on global rank 0, take the
        run directory: create it, lock it (one trainer per directory) and, for a fresh run
        (``trainer.resume: false``), refuse or archive an earlier run's files. Idempotent; the
        ``train`` command calls it before any output goes to the run's log."""
        if self._claimed:
            return
        check_run_inputs(self.cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(self.run_dir)
            if not self.cfg.trainer.resume:
                claim_fresh(self.run_dir, archive=self.cfg.trainer.archive_previous)
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
        if has_gpu():
            check_fits(cfg, dist.get_world_size(), torch.cuda.get_device_properties(0).total_memory / 2**30,
                       nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
        # TIR: code runs on rank 0 only and its output is broadcast, so every rank's episodes agree; the
        # sandbox starts first so that a machine without full isolation refuses before any model loads
        self.executor = SandboxExecutor(cfg.tir.sandbox) if cfg.tir.enabled and self.rank == 0 else None
        self.model_dir = self._model_dir()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = pad_id(self.tokenizer)
        dataset = PromptDataset.from_config(cfg.data, self.tokenizer, cfg.rollout.sampling.max_prompt_length,
                                            split="train").head(cfg.data.max_train_prompts)
        for line in dataset.report(cfg.rollout.sampling.max_prompt_length) if self.rank == 0 else ():
            say(f"data: {line}")
        self.sampler = PromptSampler(dataset, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.reward_fn = build_reward(cfg.reward) if self.rank == 0 else None
        self.args = hf_to_megatron(load_hf_config(self.model_dir))
        self._start_rollout(resumed=self._build_models())
        self.batches = build_batch_source(cfg, self.rollout, self.sampler, Scorer(cfg, self.reward_fn),
                                          tokenizer=self.tokenizer, executor=self.executor)
        self.logger = open_run_logger(cfg, self.iteration) if self.rank == 0 else None

    def _model_dir(self) -> Path:
        """The HF directory the engine and the Megatron model start from (a tiny model is created,
        and warm-started if asked, once per run directory)."""
        path = base_model_dir(self.cfg)
        if self.cfg.model.hf_path is not None:
            return check_model_dir(path, "model.hf_path")
        if not (path / "config.json").is_file():
            self.phases.enter("warm_start")
            if self.rank == 0:
                make_base_model(self.cfg, path)
        dist.barrier()
        return path

    def _build_models(self) -> bool:
        cfg = self.cfg
        self.phases.enter("model_build")
        with watching(self.phases.watch):  # checksums, HF weights and a checkpoint, read from shared storage
            ckpt = intact_checkpoint(self.run_dir, log=say if self.rank == 0 else lambda line: None) if (
                cfg.trainer.resume) else None
            total_steps = cfg.trainer.iterations * cfg.trainer.updates_per_iteration
            policy = build_policy(self.args, cfg, self.model_dir, total_steps, resuming=ckpt is not None)
            self.policy, self.optimizer, self.scheduler, self.policy_module = (
                policy.model, policy.optimizer, policy.scheduler, policy.module)
            self.routing = RoutingPlan.for_config(cfg)
            self.reference = None  # with LoRA: the policy itself, scored with its adapters off
            if needs_ref_logprobs(cfg.loss):
                self.reference = (self.policy if cfg.lora.enabled else
                                  build_reference(self.args, cfg, cfg.model.load or self.model_dir))
            resumed = ckpt is not None and self._resume(ckpt)
        self.need_old = needs_old_logprobs(cfg.loss.name) or cfg.trainer.mismatch_metrics or self.routing.needs_old_pass
        chunks, reference = model_chunks(self.policy), [m for m in [self.reference] if m not in (None, self.policy)]
        offloader = offloader_for(cfg.rollout, chunks, self.optimizer, reference, on_cpu=cfg.trainer.phase_ledger)
        self.phases.attach(offloader=offloader, measure=TrainingStateOffloader(chunks, self.optimizer, (), reference))
        return resumed  # from the run's newest intact checkpoint (then no initial policy weights were read)

    def _resume(self, ckpt: Path) -> bool:
        extra = load_checkpoint(ckpt, self.policy_module, optimizer=self.optimizer, opt_param_scheduler=self.scheduler)
        line = relayout_line(ckpt, read_metadata(ckpt).get("layout", {}), current_layout(self.optimizer),
                             perturbed=self.cfg.perturbation.enabled)
        if line and self.rank == 0:
            say(line)
        self.iteration, self.step = int(extra["iteration"]), int(extra["step"])
        if int(extra.get("policy_version", self.iteration)) != self.iteration:
            raise InputError(f"checkpoint {ckpt}: policy version {extra['policy_version']} does not match its "
                             f"iteration {self.iteration}")
        self.sampler.load_state_dict(extra["sampler"])
        if self.rank == 0:
            say(f"resumed from {ckpt} at iteration {self.iteration}, step {self.step}")
        return True

    def _start_rollout(self, resumed: bool) -> None:
        cfg = self.cfg
        t0 = time.time()
        self.phases.enter("engine_start")  # the engine claims its memory while Megatron's state is away
        self.rollout = DistributedRollout(cfg.rollout, str(self.model_dir), seed=cfg.trainer.seed,
                                          scorer=probe_mismatch, version=self.iteration,
                                          background=cfg.trainer.max_staleness > 0, phase=self.phases.within,
                                          lora=cfg.lora)
        self.phases.attach(rollout=self.rollout)
        if self.rank == 0:
            say(f"rollout engine: {self.rollout.replicas} {cfg.rollout.engine} replica(s) ready in {time.time() - t0:.0f} s")
        pin_trainer_cores(cfg.rollout)
        if cfg.trainer.max_staleness and cfg.tir.enabled and self.rollout.replica is not None:
            if self.executor is None:
                self.executor = SandboxExecutor(cfg.tir.sandbox)  # each replica leader runs its episodes' code
            self.executor.cores = self.rollout.engine_cores
        if resumed or cfg.model.load is not None:
            self.phases.enter("weight_sync")
            self.rollout.sync_weights(self.policy_module, version=self.iteration)

    # ------------------------------------------------------------------------------- loop

    def train(self) -> None:
        t = self.cfg.trainer
        if self.iteration >= t.iterations:
            if self.rank == 0:
                say(f"{self.run_dir} has finished its trainer.iterations={t.iterations}: nothing to train (raise "
                    "trainer.iterations to continue it, or choose another trainer.output_dir)")
            return
        started = time.time()
        if t.eval_interval and t.validate_base and self.iteration == 0:  # where the validation curve starts
            base = self.validate()
            if self.rank == 0:
                self.logger.log(-1, {"step": 0, **base})
        while self.iteration < t.iterations:
            metrics = self.train_iteration()
            self.iteration += 1
            if t.eval_interval and (self.iteration % t.eval_interval == 0 or self.iteration == t.iterations):
                metrics.update(self.validate())
            if self.rank == 0:
                self.logger.log(self.iteration - 1, metrics)
            saved = self.iteration % t.save_interval == 0 or self.iteration == t.iterations
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
                                        self.cfg.eval.k)
            self.logger.summary(values)
            for line in lines:
                say(line)

    def train_iteration(self) -> dict:
        cfg, m = self.cfg, {}
        t_start = time.time()
        seed_everything(derive_seed(cfg.trainer.seed, self.iteration) % (2**31))
        self.phases.iteration = self.iteration
        self.phases.enter("rollout")
        kill_engine_at_rollout(self.rollout, self.iteration)
        groups = self.batches.next_batch(self.iteration, m)
        m.update(memory_in_use("rollout"))
        m.update(self.rollout.take_stats())
        m.update(staleness_metrics(groups.trajectories, self.iteration, cfg.rollout.partial_rollout))
        share = local_share(cfg, groups, self.rollout, self.pad_id, self.args.transformer["hidden_size"],
                            probe=layer_probe_due(cfg.perturbation, self.iteration))
        batch, local, sizes = share.batch, share.local, share.sizes
        m.update(share.balance)
        divergence = None  # sigma per layer (perturbation.calibration_mode: per_layer) needs the engine awake
        if share.probe is not None:
            self.phases.enter("layer_probe")
            with timed(m, "layer_probe"):
                divergence = layer_input_divergence(self.policy, self.rollout, share.probe, self.routing.update.replay)
        self.phases.enter("logprob")
        with peak_memory(m, "logprob"):
            self._logprob_passes(local, m, divergence)
        self.phases.enter("policy_update")
        with peak_memory(m, "update"), timed(m, "update"):
            step_stats, loss_metrics = self._update(local, sizes)
        self.phases.enter("weight_sync")
        with peak_memory(m, "sync"), timed(m, "sync"):
            sync_stats = self.rollout.sync_weights(self.policy_module, version=self.iteration + 1)
        m.update(self.phases.take_stats())
        m["timing/total_s"] = time.time() - t_start

        out = from_last_stage({"step": self.step, **mean_dicts(loss_metrics)})
        out.update(batch_metrics(cfg, groups, share.truncated))
        out.update(data_metrics(self.batches.resume_state()))
        out.update(update_metrics(step_stats))
        out.update(learning_rates(self.optimizer))
        out.update(gather_sigma_stats(self.policy_module))
        out.update(routing_metrics(self.policy))
        out.update(m)
        out.update({k: v for k, v in (sync_stats or {}).items() if isinstance(v, (int, float))})
        out.update(throughput_metrics(float(batch.lengths.sum().item()), m))
        dump_token_probs(self.cfg.trainer.token_prob_samples, local, self.run_dir, self.iteration)
        return out

    def _logprob_passes(self, local, m: dict, divergence: Optional[list[float]]) -> None:
        """The unperturbed old-policy pass (when the loss, the mismatch metrics or routing replay need
        it), sigma calibration when due (``divergence``: the layer probe's), and the reference pass."""
        cfg = self.cfg
        passes = dict(batching=Batching.for_logprobs(cfg.trainer), temperature=cfg.rollout.sampling.temperature,
                      pad_id=self.pad_id, fused=cfg.trainer.fused_linear_logprobs)
        calibrate = calibration_due(cfg.perturbation, self.iteration)
        with timed(m, "old_logprob"):
            if self.need_old or calibrate:
                local.old_logprobs = compute_logprobs(self.policy, local, routing=self.routing.old, **passes)
        if calibrate:
            with timed(m, "calibration"):
                m.update(calibrate_sigma(self.policy, local, cfg.perturbation, iteration=self.iteration,
                                         replay=self.routing.update.replay, divergence=divergence, **passes))
            sigmas = gather_sigma_stats(self.policy_module)
            if self.rank == 0:
                say(calibration_line(m, sigmas, cfg.perturbation.calibration_target, self.iteration))
        with timed(m, "ref_logprob"):
            if self.reference is not None:
                with adapters_disabled(self.reference):
                    local.ref_logprobs = compute_logprobs(self.reference, local, routing=self.routing.ref, **passes)

    def _update(self, local, sizes: list[int]) -> tuple[list[dict], list[dict]]:
        """One optimizer step per mini-batch; each step's stats and its reduced loss metrics."""
        cfg = self.cfg
        step_stats, loss_metrics = [], []
        for mini in mini_batches(local, sizes):
            metrics = StepMetrics()
            step_stats.append(train_mini_batch(
                self.policy, self.optimizer, mini, loss_cfg=cfg.loss, step=self.step,
                batching=Batching.for_update(cfg.trainer), temperature=cfg.rollout.sampling.temperature,
                pad_id=self.pad_id, metrics=metrics, fused=cfg.trainer.fused_linear_logprobs,
                routing=self.routing.update))
            self.scheduler.step(1)
            self.step += 1
            loss_metrics.append(metrics.reduce(ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else {})
        return step_stats, loss_metrics

    def validate(self) -> dict:
        """``val/*`` metrics of the current policy on ``data.val_files`` (rank 0; {} elsewhere), with
        the same sample seeds at every evaluation (see :class:`~megatron_alp.batches.evaluation.Validation`)."""
        if self._validation is None:
            self._validation = Validation(self.cfg, self.tokenizer, self.rollout.max_model_len,
                                          log=say if self.rank == 0 else lambda msg: None)
        t0 = time.time()
        self.phases.enter("validation")
        out = self._validation.run(self.rollout, seed=sample_seed(self.cfg, VALIDATION_STREAM),
                                   reward_fn=self.reward_fn, tokenizer=self.tokenizer, executor=self.executor)
        self.phases.take_stats()  # the moves of validation stay out of the next iteration's offload/* metrics
        self.rollout.take_stats()  # validation rollouts stay out of the next iteration's rollout/* metrics
        out["timing/val_s"] = time.time() - t0
        return out

    def _plot(self) -> None:
        """Redraw the diagnostic figures (rank 0) whenever a checkpoint lands."""
        if self.rank != 0:
            return
        try:
            self.logger.figures(make_plots([self.run_dir], log=lambda msg: None))
        except Exception as err:  # a figure must never take the run down
            say(f"plot: skipped ({err})")

    # ------------------------------------------------------------------------------- checkpoints

    def save(self) -> None:
        self.phases.enter("checkpoint_save")
        extra = {"iteration": self.iteration, "step": self.step, "sampler": self.batches.resume_state(),
                 "policy_version": self.rollout.version}
        with watching(self.phases.watch, saving=checkpoint_dir(self.run_dir, self.iteration)):
            save_checkpoint(checkpoint_dir(self.run_dir, self.iteration), self.policy_module, optimizer=self.optimizer,
                            opt_param_scheduler=self.scheduler, extra=extra, hf_dir=self.model_dir,
                            before_commit=kill_during_save)
        if self.rank == 0:
            prune_checkpoints(self.run_dir, self.cfg.trainer.keep_checkpoints, upto=self.iteration)
        dist.barrier()

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
