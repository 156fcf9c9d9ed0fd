"""`megatron-alp train CONFIG.yaml [key=value ...]`: the RL recipe.

One iteration, as in the paper's setup:
  sample prompts -> rollouts from the inference engine (n per prompt) -> rewards -> group
  advantages -> [old-policy and reference logprob passes, unperturbed] -> k policy-update
  mini-batches with the chosen loss (perturbed forward for ALP) -> weight sync to the engine.

With ``trainer.max_staleness`` k >= 1 (asynchronous, engines on devices of their own) the
engines generate batches b+1..b+k while the trainer updates on batch b: each batch is submitted
when the trainer starts iteration b (its weights are then at most k versions old when it is trained)
and collected when its turn comes; weight syncs wait for the engines between generations. Every
trajectory carries the version that generated it (``staleness/*`` metrics).

Every rank runs this file under torchrun. Prompt sampling is deterministic and identical on all
ranks; rollouts and rewards are produced once and broadcast; each data-parallel rank trains on
its share of every mini-batch, so an optimizer step sees the same rows on any number of ranks.
Randomness is re-derived from (seed, iteration) at the start of every iteration, each rollout
sample from (seed, iteration[, dynamic-sampling round], prompt, sample)
(``rollout.sampling.per_sample_seeds``) and ALP noise from (seed, step, micro-batch, ranks), so a
resumed run replays exactly what an uninterrupted run would have done, and another parallel
layout samples the same rollouts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from megatron_alp.comm import comm_device
from megatron_alp.config import Config, ConfigError, InputError, load_config
from megatron_alp.console import library_output_to, log_name, say
from megatron_alp.offload import KINDS, TrainingStateOffloader
from megatron_alp.platform import has_gpu
from megatron_alp.seeding import derive_seed
from megatron_alp.tir.sandbox import SandboxExecutor

# Modules that import Megatron-Core, vLLM or transformers are imported inside the methods that use
# them: the run's console redirection (`run`) is in place by then, so their import-time warnings go
# to RUN_DIR/logs/engine.log instead of the terminal.


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. loss.name=alp_seq")


def run(args) -> int:
    # Validation imports the registered engines (and with them Megatron-Core), whose import-time
    # warnings belong in the run's log, which only the validated config locates: hold them until then.
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("default")
        cfg = load_config(args.config, args.overrides)
    with library_output_to(Path(cfg.trainer.output_dir) / "logs" / log_name()) as log:
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if int(os.environ.get("RANK", "0")) == 0:
            say(f"megatron-alp: engine and library output goes to {log}")
        forks_die_with_their_parent()
        trainer = RLTrainer(cfg)
        try:
            trainer.setup()
            trainer.train()
        finally:
            trainer.close()
    return 0


# seed key of validation sampling, apart from every iteration's (seed, iteration) stream
_VALIDATION_STREAM = -1


@dataclass
class _Submitted:
    """A batch handed to the engines ahead of its iteration (asynchronous training)."""

    prompts: list
    sampler_state: dict  # the prompt sampler before these prompts were drawn: where a resume restarts
    batch: Any  # megatron_alp.rollout.distributed.Batch


def _seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.output_dir)
        self.iteration = 0
        self.step = 0
        self.logger = None
        self.rollout = None
        self.executor = None
        self._validation = None
        self.max_staleness = cfg.trainer.max_staleness
        self._submitted: dict[int, _Submitted] = {}  # iteration -> its batch, generating ahead

    # ------------------------------------------------------------------------------- setup

    def setup(self) -> None:
        from megatron.core import parallel_state as ps

        from megatron_alp.data import PromptDataset, PromptSampler, load_tokenizer
        from megatron_alp.models.families import hf_to_megatron, load_hf_config
        from megatron_alp.parallel import init_distributed
        from megatron_alp.rewards import build_reward

        cfg = self.cfg
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        self.rank = dist.get_rank()
        self.ps = ps
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(self.run_dir)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self._check_batch_layout()
        if has_gpu():
            from megatron_alp.plan import check_fits

            check_fits(cfg, dist.get_world_size(), torch.cuda.get_device_properties(0).total_memory / 2**30,
                       nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
        # TIR: code runs on rank 0 only and its output is broadcast, so every rank's episodes agree; the
        # sandbox starts first so that a machine without full isolation refuses before any model loads
        self.executor = SandboxExecutor(cfg.tir.sandbox) if cfg.tir.enabled and self.rank == 0 else None
        self.model_dir = self._prepare_model_dir()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        sampling = cfg.rollout.sampling
        self.dataset = PromptDataset.from_config(
            cfg.data, self.tokenizer, sampling.max_prompt_length, split="train").head(cfg.data.max_train_prompts)
        if self.rank == 0 and getattr(self.dataset, "skipped", None):
            say(f"data: skipped rows {dict(self.dataset.skipped)}")
        self.sampler = PromptSampler(self.dataset, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.reward_fn = build_reward(cfg.reward) if self.rank == 0 else None
        self.args = hf_to_megatron(load_hf_config(self.model_dir))
        self._build_models()
        resumed = self._maybe_resume()
        self._start_rollout(resumed)
        from megatron_alp.run_log import RunLogger

        if self.rank == 0:
            self.logger = RunLogger(
                self.run_dir,
                total_iterations=cfg.trainer.iterations,
                start_iteration=self.iteration,
                tensorboard=cfg.trainer.tensorboard,
                wandb_project=cfg.trainer.wandb_project,
                progress_bar=cfg.trainer.progress_bar,
                config=cfg.model_dump(mode="json"),
            )

    def _check_batch_layout(self) -> None:
        t, n = self.cfg.trainer, self.cfg.rollout.sampling.n
        dp = self.ps.get_data_parallel_world_size()
        total = t.prompts_per_iteration * n
        if total % (dp * t.updates_per_iteration):
            raise ConfigError(
                f"trainer.prompts_per_iteration * rollout.sampling.n = {total} responses must split evenly "
                f"into data-parallel size {dp} x trainer.updates_per_iteration {t.updates_per_iteration}"
            )

    def _prepare_model_dir(self) -> Path:
        """The HF directory the engine and the Megatron model start from (a tiny model is created,
        and warm-started if asked, once per run directory)."""
        cfg = self.cfg
        if cfg.model.hf_path is not None:
            path = Path(cfg.model.hf_path)
            if not (path / "config.json").is_file():
                raise ConfigError(f"model.hf_path: {path} has no config.json (expected a Hugging Face model dir)")
            return path
        path = self.run_dir / "base_model"
        if self.rank == 0 and not (path / "config.json").is_file():
            self._make_tiny_base(path)
        dist.barrier()
        return path

    def _make_tiny_base(self, path: Path) -> None:
        import shutil

        from megatron_alp.data import PromptDataset, load_tokenizer
        from megatron_alp.models.tiny import make_tiny_model
        from megatron_alp.warmstart import warm_start, warmup_examples

        cfg = self.cfg
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(cfg.model.tiny, tmp, seed=cfg.trainer.seed, **cfg.model.tiny_config)
        if cfg.trainer.sft_warmup_steps:
            tok = load_tokenizer(tmp)
            data = PromptDataset.from_config(cfg.data, tok, cfg.rollout.sampling.max_prompt_length, split="train")
            examples = warmup_examples(data, tok, cfg.trainer.sft_warmup_format, cfg.tir.tool_format,
                                       unboxed=cfg.trainer.sft_warmup_unboxed, seed=cfg.trainer.seed)
            stats = warm_start(tmp, examples, tok, steps=cfg.trainer.sft_warmup_steps, lr=cfg.trainer.sft_warmup_lr,
                               seed=cfg.trainer.seed)
            say(f"warm start: loss {stats['warmstart/first_loss']:.3f} -> {stats['warmstart/last_loss']:.3f} "
                f"in {stats['warmstart/steps']} steps")
        os.replace(tmp, path)

    def _build_models(self) -> None:
        from megatron_alp.models.builder import build_gpt_model
        from megatron_alp.models.hf_weights import load_hf_weights
        from megatron_alp.optim import build_optimizer, wrap_for_training
        from megatron_alp.policy_loss import needs_old_logprobs, needs_ref_logprobs
        from megatron_alp.routing_replay import RoutingPlan

        cfg = self.cfg
        policy = build_gpt_model(self.args, cfg.model, cfg.parallel, cfg.perturbation, moe=cfg.moe)
        self.routing = RoutingPlan.for_config(cfg)
        if cfg.model.load is None:
            load_hf_weights(policy, self.model_dir)
        self.policy = wrap_for_training(policy, cfg.parallel)
        total_steps = cfg.trainer.iterations * cfg.trainer.updates_per_iteration
        self.optimizer, self.scheduler = build_optimizer(
            self.policy, cfg.optimizer, cfg.perturbation, cfg.parallel, total_steps
        )
        if cfg.model.load is not None:
            from megatron_alp.dist_checkpoint import load_checkpoint

            load_checkpoint(cfg.model.load, self.policy_module, strict=True)
        self.reference = None
        if needs_ref_logprobs(cfg.loss):
            self.reference = build_gpt_model(self.args, cfg.model, cfg.parallel, perturbation=None, moe=cfg.moe)
            if cfg.model.load is None:
                load_hf_weights(self.reference, self.model_dir)
            else:
                from megatron_alp.dist_checkpoint import load_checkpoint

                load_checkpoint(cfg.model.load, self.reference, strict=False)
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.need_old = needs_old_logprobs(cfg.loss.name) or cfg.trainer.mismatch_metrics or self.routing.needs_old_pass
        r = cfg.rollout
        kinds = tuple(kind for kind, on in zip(KINDS, (r.offload_weights, r.offload_grads, r.offload_optimizer)) if on)
        self.offloader = None
        if has_gpu() and r.free_memory_during_training and kinds and r.placement == "colocated":
            from megatron_alp.policy_update import model_chunks

            chunks = model_chunks(self.policy) + ([self.reference] if self.reference is not None else [])
            self.offloader = TrainingStateOffloader(chunks, self.optimizer, kinds)

    @property
    def policy_module(self):
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.policy)

    def _maybe_resume(self) -> bool:
        from megatron_alp.dist_checkpoint import latest_checkpoint, load_checkpoint

        if not self.cfg.trainer.resume:
            return False
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return False
        extra = load_checkpoint(ckpt, self.policy_module, optimizer=self.optimizer,
                                opt_param_scheduler=self.scheduler)
        self.iteration, self.step = int(extra["iteration"]), int(extra["step"])
        if int(extra.get("policy_version", self.iteration)) != self.iteration:
            raise InputError(f"checkpoint {ckpt}: policy version {extra['policy_version']} does not match its "
                             f"iteration {self.iteration}")
        self.sampler.load_state_dict(extra["sampler"])
        if self.rank == 0:
            say(f"resumed from {ckpt} at iteration {self.iteration}, step {self.step}")
        return True

    def _start_rollout(self, resumed: bool) -> None:
        from megatron_alp.policy_update import probe_mismatch
        from megatron_alp.rollout import DistributedRollout

        cfg = self.cfg
        with self._engine_awake({}, start=True):  # the engine claims its memory while Megatron's state is away
            self.rollout = DistributedRollout(cfg.rollout, str(self.model_dir), seed=cfg.trainer.seed,
                                              scorer=probe_mismatch, version=self.iteration,
                                              background=self.max_staleness > 0)
        if not has_gpu():
            from megatron_alp.rollout.placement import trainer_cores

            keep = trainer_cores(cfg.rollout)
            if keep:  # separate placement: the engines compute on the other cores
                os.sched_setaffinity(0, keep)
                torch.set_num_threads(min(torch.get_num_threads(), len(keep)))
        if self.max_staleness and cfg.tir.enabled and self.rollout.replica is not None:
            if self.executor is None:
                self.executor = SandboxExecutor(cfg.tir.sandbox)  # each replica leader runs its episodes' code
            self.executor.cores = self.rollout.engine_cores
        if resumed or cfg.model.load is not None:
            self.rollout.sync_weights(self.policy_module, version=self.iteration)

    @contextlib.contextmanager
    def _engine_awake(self, stats: dict, start: bool = False):
        """The rollout window of a colocated GPU run: Megatron's state is offloaded
        (``rollout.offload_*``) and the allocator cache emptied while the engine is awake, and comes
        back after the engine sleeps. ``start``: the window in which the engine is created."""
        if self.offloader is not None:
            stats.update(self.offloader.offload())
        if not start:
            self.rollout.wake_up()
        try:
            yield
        finally:
            if self.rollout is not None:  # None: the engine failed to start
                self.rollout.sleep()
            if self.offloader is not None:
                stats.update(self.offloader.reload())

    # ------------------------------------------------------------------------------- loop

    def train(self) -> None:
        t = self.cfg.trainer
        while self.iteration < t.iterations:
            metrics = self.train_iteration()
            self.iteration += 1
            if t.eval_interval and (self.iteration % t.eval_interval == 0 or self.iteration == t.iterations):
                metrics.update(self.validate())
            if self.rank == 0:
                self.logger.log(self.iteration - 1, metrics)
            if self.iteration % t.save_interval == 0 or self.iteration == t.iterations:
                self.save()
                self._plot()

    def _plot(self) -> None:
        """Redraw the diagnostic figures (rank 0) whenever a checkpoint lands."""
        if self.rank != 0:
            return
        from megatron_alp.plot import make_plots

        try:
            make_plots([self.run_dir], log=lambda msg: None)
        except Exception as err:  # a figure must never take the run down
            say(f"plot: skipped ({err})")

    def _sample_seed(self, *keys: int):
        """Per-sample seed of the sampling stream ``keys`` (None when rollouts are unseeded)."""
        from megatron_alp.platform import has_gpu

        s = self.cfg.rollout.sampling
        seeded = s.per_sample_seeds if s.per_sample_seeds is not None else not has_gpu()
        return derive_seed(self.cfg.trainer.seed, *keys) if seeded else None

    def _sampling_params(self, iteration: int, round_: int = 0):
        """Sampling settings of ``iteration``'s batch; ``round_`` > 0: a dynamic-sampling round's,
        seeded from (seed, iteration, round)."""
        from megatron_alp.rollout.base import SamplingParams

        s = self.cfg.rollout.sampling
        keys = (iteration, round_) if round_ else (iteration,)
        return SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_tokens=s.max_response_length, seed=self._sample_seed(*keys))

    def _rollouts(self, prompts, round_: int = 0) -> list:
        """Trajectories of ``prompts``, generated now by every replica with the current weights."""
        from megatron_alp.tir.multi_turn import sample_trajectories

        trajectories = sample_trajectories(self.rollout, [p.prompt_ids for p in prompts],
                                           self._sampling_params(self.iteration, round_), self.cfg.tir,
                                           self.tokenizer, self.executor, broadcast=self.rollout._broadcast)
        for t in trajectories:
            t.policy_version = self.rollout.version
        return trajectories

    def _sample_groups(self, timing: dict):
        """This iteration's scored GRPO groups: ``trainer.prompts_per_iteration`` prompts (generated
        ahead with asynchronous training), or with ``trainer.dynamic_sampling`` as many rounds as it
        takes to fill the batch with groups whose rewards differ
        (:func:`~megatron_alp.dynamic_sampling.fill_batch`; extra rounds are generated now, with the
        current weights). Collective: every rank draws the same prompts and gets the same rewards, so
        all agree on the rounds."""
        from megatron_alp.dynamic_sampling import Groups, fill_batch

        t = self.cfg.trainer
        if self.max_staleness:
            prompts, trajectories = self._async_rollouts(timing)
            t0 = time.time()
            first = Groups(prompts, trajectories, self._rewards(trajectories, prompts))
            timing["timing/reward_s"] = time.time() - t0
            timing["rollout/response_tokens"] = float(sum(len(t.response_ids) for t in trajectories))
        else:
            first = self._scored_round(self.sampler.next_batch(t.prompts_per_iteration), 0, timing)
        if not t.dynamic_sampling:
            return first
        groups, stats = fill_batch(first, lambda k, r: self._scored_round(self.sampler.next_batch(k), r, timing),
                                   wanted=t.prompts_per_iteration, n=self.cfg.rollout.sampling.n,
                                   max_rounds=t.dynamic_sampling_max_rounds)
        timing.update(stats)
        return groups

    def _scored_round(self, prompts, round_: int, timing: dict):
        """One generation round: ``prompts``' rollouts and rewards (timed into ``timing``)."""
        from megatron_alp.dynamic_sampling import Groups

        t0 = time.time()
        trajectories = self._rollouts(prompts, round_)
        t1 = time.time()
        rewards = self._rewards(trajectories, prompts)
        timing["timing/rollout_s"] = timing.get("timing/rollout_s", 0.0) + t1 - t0
        timing["timing/reward_s"] = timing.get("timing/reward_s", 0.0) + time.time() - t1
        timing["rollout/response_tokens"] = timing.get("rollout/response_tokens", 0.0) + float(
            sum(len(t.response_ids) for t in trajectories))
        return Groups(prompts, trajectories, rewards)

    # ----------------------------------------------------------------- asynchronous rollouts

    def _share_work(self, params):
        """What a replica leader's producer runs for its share of a batch: trajectories per prompt.
        Multi-turn episodes run whole on the leader, its code in the leader's own sandbox."""
        from dataclasses import replace

        from megatron_alp.rollout.base import Trajectory
        from megatron_alp.tir.multi_turn import run_episodes

        tir, tokenizer, n = self.cfg.tir, self.tokenizer, params.n

        def work(engine, prompts, keys):
            if not tir.enabled:
                return [[Trajectory.from_completion(c) for c in g] for g in engine.generate(prompts, params, keys=keys)]
            # episodes draw from a stream of this share (seeded by its first prompt's index in the batch)
            seeded = params if params.seed is None else replace(params, seed=derive_seed(params.seed, keys[0]))
            episodes = run_episodes(engine, prompts, tokenizer, seeded, tir, self.executor)
            return [episodes[i * n:(i + 1) * n] for i in range(len(prompts))]

        return work

    def _submit(self, iteration: int) -> None:
        """Draw the prompts of ``iteration`` and queue them on the engines (collective)."""
        state = self.sampler.state_dict()
        prompts = self.sampler.next_batch(self.cfg.trainer.prompts_per_iteration)
        params = self._sampling_params(iteration)
        batch = self.rollout.submit([p.prompt_ids for p in prompts], params, self._share_work(params))
        self._submitted[iteration] = _Submitted(prompts, state, batch)

    def _async_rollouts(self, timing: dict) -> tuple[list, list]:
        """This iteration's prompts and trajectories (generated ahead), after queueing the batches of
        the next ``max_staleness`` iterations. Groups generated by weights more than ``max_staleness``
        versions old are regenerated now (a guard: the submission schedule keeps them fresh)."""
        last = min(self.iteration + self.max_staleness, self.cfg.trainer.iterations - 1)
        for j in range(self.iteration, last + 1):
            if j not in self._submitted:
                self._submit(j)
        submitted = self._submitted.pop(self.iteration)
        t0 = time.time()
        batch = self.rollout.collect(submitted.batch)
        timing["timing/rollout_wait_s"] = time.time() - t0
        timing["timing/rollout_s"] = batch.seconds
        stale = [i for i, v in enumerate(batch.versions) if self.iteration - v > self.max_staleness]
        if stale:
            params = self._sampling_params(self.iteration)
            again = self.rollout.collect(self.rollout.submit([batch.prompts[i] for i in stale], params,
                                                             self._share_work(params)))
            for i, group, version in zip(stale, again.results, again.versions):
                batch.results[i], batch.versions[i] = group, version
        timing["staleness/regenerated_groups"] = float(len(stale))
        trajectories = []
        for group, version in zip(batch.results, batch.versions):
            for t in group:
                t.policy_version = version
                trajectories.append(t)
        return submitted.prompts, trajectories

    def _resume_sampler_state(self) -> dict:
        """The sampler where a resumed run must restart: before the oldest batch not yet trained on
        (batches generating ahead are discarded by a kill and drawn again)."""
        if self._submitted:
            return self._submitted[min(self._submitted)].sampler_state
        return self.sampler.state_dict()

    def validate(self) -> dict:
        """``val/*`` metrics of the current policy on ``data.val_files`` (rank 0; {} elsewhere), with
        the same sample seeds at every evaluation (see :class:`~megatron_alp.evaluate.Validation`)."""
        from megatron_alp.evaluate import Validation

        if self._validation is None:
            self._validation = Validation(self.cfg, self.tokenizer, self.rollout.max_model_len,
                                          log=say if self.rank == 0 else lambda msg: None)
        t0 = time.time()
        self.rollout.wake_up()
        out = self._validation.run(self.rollout, seed=self._sample_seed(_VALIDATION_STREAM), reward_fn=self.reward_fn,
                                   tokenizer=self.tokenizer, executor=self.executor, broadcast=self.rollout._broadcast)
        self.rollout.sleep()
        self.rollout.take_stats()  # validation rollouts stay out of the next iteration's rollout/* metrics
        out["timing/val_s"] = time.time() - t0
        return out

    def _overlong_penalties(self, trajectories) -> list[float]:
        from megatron_alp.rewards.overlong import overlong_penalty

        r, limit = self.cfg.reward, self.cfg.rollout.sampling.max_response_length
        return [overlong_penalty(len(t.response_ids), limit, r.overlong_buffer, r.overlong_penalty)
                for t in trajectories]

    def _rewards(self, trajectories, prompts) -> torch.Tensor:
        """Rank 0 scores the responses (``reward.overlong_buffer``: plus the overlong punishment);
        every rank gets the rewards, as a CPU tensor."""
        n = self.cfg.rollout.sampling.n
        rewards = torch.zeros(len(trajectories), dtype=torch.float32, device=comm_device())
        if self.rank == 0:
            truths = [prompts[i // n].ground_truth for i in range(len(trajectories))]
            scores = self.reward_fn([t.response_text for t in trajectories], truths)
            if self.cfg.reward.overlong_buffer:
                scores = [s + p for s, p in zip(scores, self._overlong_penalties(trajectories))]
            rewards = torch.tensor(scores, dtype=torch.float32, device=comm_device())
        dist.broadcast(rewards, src=0)
        return rewards.cpu()

    def _dp_shard(self, batch):
        """This data-parallel rank's rows and their mini-batch sizes, and the imbalance of the split
        (max / mean estimated cost per rank, worst mini-batch) with and without balancing."""
        from megatron_alp.balance import imbalance, sequence_cost
        from megatron_alp.rl_batch import dp_assignment, dp_shard

        t, dp = self.cfg.trainer, self.ps.get_data_parallel_world_size()
        hidden = self.args.transformer["hidden_size"]
        costs = [sequence_cost(n, hidden) for n in batch.lengths.tolist()]
        split = {balanced: dp_assignment(len(batch), dp, t.updates_per_iteration, costs if balanced else None)
                 for balanced in {False, t.balance_data_parallel}}
        worst = {b: max(imbalance([sum(costs[i] for i in rows) for rows in part]) for part in a)
                 for b, a in split.items()}
        local, sizes = dp_shard(batch, split[t.balance_data_parallel], self.ps.get_data_parallel_rank())
        return local, sizes, {"batch/dp_imbalance": worst[t.balance_data_parallel],
                              "batch/dp_imbalance_unbalanced": worst[False]}

    def train_iteration(self) -> dict:
        from megatron_alp.advantages import group_advantages
        from megatron_alp.calibration import calibrate_sigma, calibration_due
        from megatron_alp.dynamic_sampling import zero_variance
        from megatron_alp.metrics import StepMetrics
        from megatron_alp.optim import learning_rates
        from megatron_alp.perturbation import gather_sigma_stats
        from megatron_alp.policy_update import compute_logprobs, train_mini_batch
        from megatron_alp.micro_batch import Batching
        from megatron_alp.rl_batch import build_rl_batch, exclude_from_loss, mini_batches
        from megatron_alp.routing_replay import routing_metrics

        cfg, ps = self.cfg, self.ps
        timing = {}
        t_start = time.time()
        _seed_everything(derive_seed(cfg.trainer.seed, self.iteration) % (2**31))

        with self._engine_awake(timing):
            groups = self._sample_groups(timing)
            timing.update(_memory("rollout", device_wide=True))
        timing.update(self.rollout.take_stats())
        trajectories, rewards, n = groups.trajectories, groups.rewards, cfg.rollout.sampling.n
        staleness = np.array([self.iteration - t.policy_version for t in trajectories], dtype=np.float64)
        timing["staleness/mean"] = float(staleness.mean())
        timing["staleness/max"] = float(staleness.max())
        if cfg.rollout.partial_rollout:
            timing["staleness/multi_version_frac"] = float(np.mean(
                [len(t.info.get("version_spans", ())) > 1 for t in trajectories]))
        advantages = group_advantages(rewards, n, cfg.advantage.norm_by_std, cfg.advantage.eps)

        batch = build_rl_batch(trajectories, advantages, self.pad_id)
        truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
        if cfg.loss.mask_truncated:
            exclude_from_loss(batch, truncated)
        local, sizes, balance_stats = self._dp_shard(batch)
        timing.update(balance_stats)
        temperature = cfg.rollout.sampling.temperature
        fused = cfg.trainer.fused_linear_logprobs
        logprob_batching = Batching.for_logprobs(cfg.trainer)
        t0 = time.time()
        _reset_peak_memory()
        calibrate = calibration_due(cfg.perturbation, self.iteration)
        if self.need_old or calibrate:
            local.old_logprobs = compute_logprobs(self.policy, local, batching=logprob_batching,
                                                  temperature=temperature, pad_id=self.pad_id, fused=fused,
                                                  routing=self.routing.old)
        timing["timing/old_logprob_s"] = time.time() - t0
        if calibrate:
            t0 = time.time()
            timing.update(calibrate_sigma(self.policy, local, cfg.perturbation, iteration=self.iteration,
                                          batching=logprob_batching, temperature=temperature, pad_id=self.pad_id,
                                          fused=fused, replay=self.routing.update.replay))
            timing["timing/calibration_s"] = time.time() - t0
            self._report_calibration(timing)
        t0 = time.time()
        if self.reference is not None:
            local.ref_logprobs = compute_logprobs(self.reference, local, batching=logprob_batching,
                                                  temperature=temperature, pad_id=self.pad_id, fused=fused,
                                                  routing=self.routing.ref)
        timing["timing/ref_logprob_s"] = time.time() - t0
        timing.update(_memory("logprob"))

        t0 = time.time()
        _reset_peak_memory()
        step_stats = []
        metric_sets = []
        for mini in mini_batches(local, sizes):
            metrics = StepMetrics()
            stats = train_mini_batch(
                self.policy, self.optimizer, mini, loss_cfg=cfg.loss, step=self.step,
                batching=Batching.for_update(cfg.trainer), temperature=temperature, pad_id=self.pad_id,
                metrics=metrics, fused=fused, routing=self.routing.update,
            )
            self.scheduler.step(1)
            self.step += 1
            step_stats.append(stats)
            metric_sets.append(metrics.reduce(ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else {})
        timing["timing/update_s"] = time.time() - t0
        timing.update(_memory("update"))

        t0 = time.time()
        _reset_peak_memory()
        sync_stats = self.rollout.sync_weights(self.policy_module, version=self.iteration + 1)
        timing["timing/sync_s"] = time.time() - t0
        timing.update(_memory("sync"))
        timing["timing/total_s"] = time.time() - t_start

        out = {"step": self.step}
        out.update(_mean_dicts(metric_sets))
        out = self._from_last_stage(out)
        out["reward/mean"] = rewards.mean().item()
        out["reward/std"] = rewards.std().item() if len(rewards) > 1 else 0.0
        resp = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
        out["response_length/mean"] = resp.mean().item()
        out["response_length/max"] = resp.max().item()
        out["response/truncated_frac"] = truncated.float().mean().item()
        out["response/masked_truncated_frac"] = out["response/truncated_frac"] if cfg.loss.mask_truncated else 0.0
        out["reward/overlong_penalty_mean"] = float(np.mean(self._overlong_penalties(trajectories)))
        out["batch/groups"] = float(len(groups))
        out["batch/zero_variance_groups"] = float(zero_variance(rewards, n).sum())
        if cfg.tir.enabled:
            from megatron_alp.tir.multi_turn import tir_metrics

            out.update(tir_metrics(trajectories))
        out["batch/micro_batches"] = float(np.mean([s["micro_batches"] for s in step_stats]))
        out["batch/padding_frac"] = 1.0 - sum(s["tokens"] for s in step_stats) / max(
            1, sum(s["computed_tokens"] for s in step_stats))
        out["grad_norm"] = float(np.mean([s["grad_norm"] for s in step_stats]))
        out["update/skipped"] = float(sum(not s["update_ok"] for s in step_stats))
        out.update(learning_rates(self.optimizer))
        out.update(gather_sigma_stats(self.policy_module))
        out.update(routing_metrics(self.policy))
        out.update(timing)
        out.update({k: v for k, v in (sync_stats or {}).items() if isinstance(v, (int, float))})
        tokens = float(batch.lengths.sum().item())
        out["throughput/tokens_per_s"] = tokens / max(timing["timing/total_s"], 1e-9)
        out["throughput/rollout_tokens_per_s"] = (timing["rollout/response_tokens"]
                                                  / max(timing["timing/rollout_s"], 1e-9))
        self._dump_token_probs(local)
        return out

    def _report_calibration(self, cal: dict) -> None:
        from megatron_alp.perturbation import gather_sigma_stats

        sigmas = [v for k, v in gather_sigma_stats(self.policy_module).items() if k.endswith("/mean") and k != "sigma/mean"]
        if self.rank == 0 and sigmas:
            say(f"sigma calibrated at iteration {self.iteration}: {cal['calibration/scale']:.3g} x layer-input RMS = "
                f"{min(sigmas):.3g}..{max(sigmas):.3g}; KL(train || perturbed) {cal['calibration/perturbed_kl']:.3g} "
                f"for a target of {cal['calibration/target_kl']:.3g} ({self.cfg.perturbation.calibration_target:g} x "
                f"the engine-train KL {cal['calibration/train_engine_kl']:.3g}), "
                f"{int(cal['calibration/evaluations'])} perturbed passes")

    def _from_last_stage(self, metrics: dict) -> dict:
        """Loss metrics live on the last pipeline stage; give every rank the same dict."""
        ps = self.ps
        last_rank = ps.get_pipeline_model_parallel_last_rank()
        box = [metrics]
        dist.broadcast_object_list(box, src=last_rank, group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _dump_token_probs(self, local) -> None:
        """Train (old, unperturbed) vs rollout token probabilities, from the rank that has both."""
        ps = self.ps
        n = self.cfg.trainer.token_prob_samples
        if not n or local.old_logprobs is None or not ps.is_pipeline_last_stage():
            return
        if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
            return
        keep = local.loss_mask > 0
        train = local.old_logprobs[keep].exp().numpy()
        rollout = local.rollout_logprobs[keep].exp().numpy()
        if len(train) > n:
            idx = np.random.default_rng(self.iteration).choice(len(train), n, replace=False)
            train, rollout = train[idx], rollout[idx]
        from megatron_alp.run_log import save_token_probs

        save_token_probs(self.run_dir, self.iteration, train, rollout)

    # ------------------------------------------------------------------------------- checkpoints

    def save(self) -> None:
        from megatron_alp.dist_checkpoint import save_checkpoint

        ckpt = self.run_dir / "checkpoints" / f"iter_{self.iteration:07d}"
        extra = {"iteration": self.iteration, "step": self.step, "sampler": self._resume_sampler_state(),
                 "policy_version": self.rollout.version}
        save_checkpoint(ckpt, self.policy_module, optimizer=self.optimizer, opt_param_scheduler=self.scheduler,
                        extra=extra, hf_dir=self.model_dir, before_commit=_fault_injection)
        if self.rank == 0:
            self._prune_checkpoints()
        dist.barrier()

    def _prune_checkpoints(self) -> None:
        import shutil

        root = self.run_dir / "checkpoints"
        done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_") and "." not in p.name)
        for old in done[: -self.cfg.trainer.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.executor is not None:
            self.executor.close()
        from megatron_alp.parallel import destroy_distributed

        destroy_distributed()


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on ``run_dir`` for the life of this process (global rank 0).

    Two trainers on one run directory would interleave metrics and overwrite each other's
    checkpoints, e.g. a resume started while the killed job's workers still run (torchrun starts
    each worker in its own session, so killing the launcher's process group leaves them alive).
    The kernel drops the lock when the process dies, even by SIGKILL, so a crash never leaves a
    stale lock behind. It is a POSIX record lock, which a forked child does not inherit (an flock
    would stay held by a child that outlived the trainer, e.g. a checkpoint writer)."""
    import fcntl

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise InputError(
            f"trainer.output_dir {run_dir} is in use by another training process (pid {holder}); "
            "stop it or choose another output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


_forking_parent = None


def forks_die_with_their_parent() -> None:
    """Every child forked (not exec'd) from this process from now on, and from its forked children,
    is killed when its parent dies. Megatron's checkpoint save forks a writer per bucket; a trainer
    killed during a save would otherwise leave those copies of itself blocked on a pipe forever,
    holding its memory and open files."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def before():
        global _forking_parent
        _forking_parent = os.getpid()

    def in_child():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != _forking_parent:  # the parent died before the line above
            os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)


def _fault_injection(ckpt_dir: Path) -> None:
    """Test hook: ``MEGATRON_ALP_KILL_DURING_SAVE=<iteration>`` SIGKILLs this process after the
    checkpoint's files are written and before it is committed, to prove resumption never trusts a
    half-written checkpoint."""
    target = os.environ.get("MEGATRON_ALP_KILL_DURING_SAVE")
    if target and Path(ckpt_dir).name.startswith(f"iter_{int(target):07d}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    out = {}
    for k in sorted(keys):
        vals = [d[k] for d in dicts if k in d and isinstance(d[k], (int, float)) and np.isfinite(d[k])]
        if not vals:
            continue
        if k.endswith("/min"):
            out[k] = float(min(vals))
        elif k.endswith("/max"):
            out[k] = float(max(vals))
        else:
            out[k] = float(np.mean(vals))
    return out


def _reset_peak_memory() -> None:
    if has_gpu():
        torch.cuda.reset_peak_memory_stats()


def _memory(phase: str, device_wide: bool = False) -> dict:
    """``memory/<phase>_*`` in GiB on GPUs ({} on the CPU): the trainer allocator's peak since the
    last reset, or with ``device_wide`` the memory in use on the whole GPU now (the engine's
    included, which may live in another process)."""
    if not has_gpu():
        return {}
    if device_wide:
        free, total = torch.cuda.mem_get_info()
        return {f"memory/{phase}_used_gib": (total - free) / 2**30}
    return {f"memory/{phase}_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
