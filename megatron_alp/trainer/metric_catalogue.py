"""Every key of a run's ``metrics.jsonl``: what it measures, its unit, the module that computes it
and when it is there. The one list of them: ``megatron-alp config-docs`` writes it into
docs/reference/metrics.md (the one generated reference of metrics), and a test holds
every key a CI-sized run writes against it, so a metric added without its entry fails there.

A key with a variable part is a pattern: ``{name}`` stands for one path segment (``sigma/{site}/mean``
is ``sigma/layer_03/mean``), ``{k}`` for a number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Metric:
    pattern: str  # the key, or a pattern of keys
    unit: str  # "" for a plain number
    module: str  # the module that computes it, under megatron_alp
    when: str  # "every iteration", or what puts it in a record
    meaning: str

    def matches(self, key: str) -> bool:
        return re.fullmatch(_regex(self.pattern), key) is not None


def _regex(pattern: str) -> str:
    parts = re.split(r"(\{\w+\})", pattern)
    return "".join("[0-9]+" if p == "{k}" else "[^/]+" if p.startswith("{") else re.escape(p) for p in parts)


METRICS: tuple[Metric, ...] = (
    Metric('batch/dp_imbalance', 'ratio', 'training.rl_batch', 'every iteration',
           "Max / mean estimated compute cost (sequence_cost: tokens plus attention's quadratic share) per data-"
           'parallel rank of the split actually used, worst mini-batch of the iteration (1.0 = perfect balance).'),
    Metric('batch/dp_imbalance_unbalanced', 'ratio', 'training.rl_batch', 'every iteration',
           'The same max / mean cost per data-parallel rank, worst mini-batch, for the plain equal contiguous '
           'split (what trainer.balance_data_parallel: false would give).'),
    Metric('batch/groups', 'count', 'trainer.metrics', 'every iteration',
           'Number of GRPO groups (prompts) in the trained batch.'),
    Metric('batch/micro_batches', 'count', 'trainer.metrics', 'every iteration',
           'Micro-batches per optimizer step of the update pass on rank 0 (its data-parallel share), mean over the'
           " iteration's steps."),
    Metric('batch/padding_frac', 'fraction', 'trainer.metrics', 'every iteration',
           "1 - real tokens / computed tokens (pad tokens included) of rank 0's update micro-batches, summed over "
           "the iteration's optimizer steps."),
    Metric('batch/zero_variance_groups', 'count', 'trainer.metrics', 'every iteration',
           'Trained groups whose n rewards are all equal (zero GRPO advantage, no learning signal).'),
    Metric('calibration/bad_tokens', 'count', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           'Loss tokens, over all data-parallel ranks, whose engine or old-policy logprob is not finite (NaN, -inf), '
           'left out of both KLs of the calibration; it falls back (calibration/fallback) only when no finite token '
           'is left.'),
    Metric('calibration/evaluations', 'count', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           'Number of candidate noise scales tried by the sigma-calibration search (each the mean of NOISE_DRAWS=4'
           ' perturbed forward passes); 0 on fallback.'),
    Metric('calibration/fallback', '', 'training.calibration', 'calibration iterations (perturbation.init_std: auto)',
           "1.0 when the measured engine-train KL was 0 or non-finite (or no token with finite logprobs was left) "
           "and every sigma was set to init_std's default (1e-4) instead of calibrated, else 0.0."),
    Metric('calibration/per_layer', '', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           '1.0 when sigma was sized per layer by a measured engine-vs-trainer drift (perturbation.calibration_mode: '
           'per_layer, the divergence of each layer input, or per_layer_added, the drift added before each layer), '
           '0.0 for the global layer-input-RMS mode.'),
    Metric('calibration/perturbed_kl', 'nats', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           'k3 estimate of KL(pi_train || pi_train,sigma) at the chosen scale, mean over 4 noise draws, over the '
           "batch's loss tokens (0.0 on fallback)."),
    Metric('calibration/scale', '', 'training.calibration', 'calibration iterations (perturbation.init_std: auto)',
           "Chosen global noise scale s, with sigma_h = s * (layer h's input RMS, or its engine-train drift in the "
           'per_layer modes; at least 1e-3 x the largest layer\'s); 0.0 on fallback.'),
    Metric('calibration/target_kl', 'nats', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           'Target perturbed KL = perturbation.calibration_target x calibration/train_engine_kl (0.0 on fallback).'),
    Metric('calibration/train_engine_kl', 'nats', 'training.calibration',
           'calibration iterations (perturbation.init_std: auto)',
           'Measured mismatch: k3 estimate of KL(pi_rollout || pi_train) from engine logprobs vs the unperturbed '
           "old-policy pass, over the batch's loss tokens on all data-parallel ranks."),
    Metric('clip/dual_frac', 'fraction', 'training.step_metrics', 'every iteration',
           'Fraction of loss tokens where the dual clip (loss.dual_clip_c, negative advantages) is active, '
           "excluding tokens masked by the loss's correction (StepMetrics.reduce over all data-parallel ranks per "
           "optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('clip/high_frac', 'fraction', 'training.step_metrics', 'every iteration',
           'Fraction of loss tokens where the upper clip 1+clip_high is active (ratio > 1 and the clipped term '
           'chosen; for CISPO: ratio > 1+clip_high), excluding masked tokens (StepMetrics.reduce over all data-'
           "parallel ranks per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('clip/low_frac', 'fraction', 'training.step_metrics', 'every iteration',
           'Fraction of loss tokens where the lower clip 1-clip_low is active (ratio < 1 and the clipped term '
           'chosen; for CISPO: ratio < 1-clip_low), excluding masked tokens (StepMetrics.reduce over all data-'
           "parallel ranks per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('data/epoch', 'epochs', 'trainer.metrics', 'every iteration',
           "Epochs of training prompts consumed, epoch + position / num_prompts of the prompt sampler's resume "
           'state (with max_staleness: before the oldest batch not yet trained on).'),
    Metric('dynamic_sampling/filled_groups', 'count', 'algorithms.dynamic_sampling', 'trainer.dynamic_sampling',
           'Groups rejected by the filter but trained anyway to complete a batch still short after '
           'dynamic_sampling_max_rounds extra rounds.'),
    Metric('dynamic_sampling/generated_groups', 'count', 'algorithms.dynamic_sampling', 'trainer.dynamic_sampling',
           'Groups generated this iteration over the first batch and all extra rounds.'),
    Metric('dynamic_sampling/kept_frac', 'fraction', 'algorithms.dynamic_sampling', 'trainer.dynamic_sampling',
           'Groups passing trainer.dynamic_sampling_filter / groups generated this iteration.'),
    Metric('dynamic_sampling/reward_mean', '', 'algorithms.dynamic_sampling', 'trainer.dynamic_sampling',
           "Mean final reward over every generated response of all rounds (reward/mean is the trained batch's)."),
    Metric('dynamic_sampling/rounds', 'count', 'algorithms.dynamic_sampling', 'trainer.dynamic_sampling',
           'Extra on-policy generation rounds drawn this iteration (0 = the first batch sufficed).'),
    Metric('entropy/mean', 'nats', 'training.step_metrics', 'every iteration',
           'Mean per-token entropy of the training forward (perturbed for ALP, at the rollout temperature) over '
           'loss tokens (StepMetrics.reduce over all data-parallel ranks per optimizer step, then mean over the '
           "iteration's steps by mean_dicts)."),
    Metric('grad_norm', '', 'trainer.metrics', 'every iteration',
           "Global gradient norm (before clipping) returned by Megatron's optimizer step, mean over the "
           "iteration's optimizer steps."),
    Metric('iteration', 'count', 'runtime.run_log', 'every record',
           '0-based index of the iteration the record describes (-1: the base-model validation record before any '
           'update); added by RunLogger.log.'),
    Metric('kl_ref/mean', 'nats', 'training.step_metrics', 'loss.kl_coef > 0',
           'Mean per-token KL estimate (loss.kl_type k1 or k3, clamped to loss.kl_clamp) of the training forward '
           'vs the reference policy over loss tokens, before kl_coef (StepMetrics.reduce over all data-parallel '
           "ranks per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('loss/entropy_bonus', '', 'training.step_metrics', 'every iteration',
           'entropy_coef x aggregated entropy of the training forward (subtracted in loss/total), per optimizer '
           "step's mini-batch (StepMetrics.reduce over all data-parallel ranks per optimizer step, then mean over "
           "the iteration's steps by mean_dicts)."),
    Metric('loss/kl', '', 'training.step_metrics', 'every iteration',
           'kl_coef x aggregated KL penalty to the reference policy (loss.aggregation over loss tokens), per mini-'
           'batch (StepMetrics.reduce over all data-parallel ranks per optimizer step, then mean over the '
           "iteration's steps by mean_dicts)."),
    Metric('loss/policy', '', 'training.step_metrics', 'every iteration',
           "Policy-objective term of the chosen loss (clipped surrogate, or CISPO's IS-weighted REINFORCE) "
           'aggregated per loss.aggregation over the mini-batch (StepMetrics.reduce over all data-parallel ranks '
           "per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('loss/total', '', 'training.step_metrics', 'every iteration',
           'Minimised loss = loss/policy + loss/kl - loss/entropy_bonus of the mini-batch (StepMetrics.reduce over'
           " all data-parallel ranks per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('lr', '', 'training.optim', 'every iteration',
           "Learning rate of the model-weight parameter group(s) after the iteration's scheduler steps."),
    Metric('lr/sigma', '', 'training.optim', 'perturbation.enabled',
           'Learning rate of the ALP sigma parameter group (perturbation.lr, constant or following the schedule).'),
    Metric('mask/frac', 'fraction', 'training.step_metrics', 'every iteration',
           "Fraction of loss tokens removed by the loss's own correction mask (Token-/Seq-MIS rho' > C, IcePop k "
           'outside [low, high]; 0 for other losses) (StepMetrics.reduce over all data-parallel ranks per '
           "optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('memory/logprob_peak_gib', 'GiB', 'trainer.phases', 'on GPUs',
           'Trainer allocator peak (torch.cuda.max_memory_allocated) during the logprob phase: old-policy pass, '
           'sigma calibration and reference pass.'),
    Metric('memory/rollout_used_gib', 'GiB', 'trainer.phases', 'on GPUs',
           "Memory in use on the whole GPU (total - free, engine included) right after the rollout phase's batch "
           'arrived.'),
    Metric('memory/sync_peak_gib', 'GiB', 'trainer.phases', 'on GPUs',
           'Trainer allocator peak during the weight sync to the engines (incl. any sync verification).'),
    Metric('memory/update_peak_gib', 'GiB', 'trainer.phases', 'on GPUs',
           'Trainer allocator peak during the policy-update phase (all optimizer steps).'),
    Metric('mismatch/chi2', '', 'training.step_metrics', 'every iteration',
           'mean((r - 1)^2) with r = pi_train / pi_rollout per loss token, pi_train the unperturbed old-policy '
           'pass (current logprobs if none) (StepMetrics.reduce over all data-parallel ranks per optimizer step, '
           "then mean over the iteration's steps by mean_dicts)."),
    Metric('mismatch/kl_k1', 'nats', 'training.step_metrics', 'every iteration',
           'k1 estimate mean(-log r) of KL(pi_rollout || pi_train) per loss token, r = pi_train / pi_rollout with '
           'the unperturbed old-policy logprobs (current logprobs if no old pass) (StepMetrics.reduce over all '
           "data-parallel ranks per optimizer step, then mean over the iteration's steps by mean_dicts)."),
    Metric('mismatch/kl_k3', 'nats', 'training.step_metrics', 'every iteration',
           'k3 estimate mean(r - 1 - log r) of KL(pi_rollout || pi_train) per loss token, unperturbed old-policy '
           'pass vs rollout engine (StepMetrics.reduce over all data-parallel ranks per optimizer step, then mean '
           "over the iteration's steps by mean_dicts)."),
    Metric('mismatch/pearson_r', '', 'training.step_metrics', 'every iteration where defined (some variance)',
           'Pearson correlation between the training (unperturbed old-policy) and rollout token probabilities over'
           " a step's loss tokens; mean over steps."),
    Metric('moe/aux_loss', '', 'training.routing_replay', 'MoE models (softmax router)',
           "Switch load-balancing loss with coefficient 1, E/(k T^2) sum_e P_e n_e over the iteration's update-"
           'pass tokens, mean over MoE layers (1 = perfectly balanced), whatever moe.aux_loss_coeff is.'),
    Metric('moe/expert_load', 'ratio', 'training.routing_replay', 'MoE models',
           'Tokens of the busiest expert / mean tokens per expert in the update pass (experts used), mean over MoE'
           ' layers (1 = even).'),
    Metric('moe/expert_load_worst_layer', 'ratio', 'training.routing_replay', 'MoE models',
           'The largest per-layer busiest/mean expert-load ratio of the update pass.'),
    Metric('moe/noise_flip_frac', 'fraction', 'training.routing_replay', 'MoE models (old-policy pass ran)',
           "Fraction of (token, layer) whose router's own top-k in the (perturbed) update pass differs from the "
           "unperturbed old-policy pass's own choice."),
    Metric('moe/replayed_frac', 'fraction', 'training.routing_replay', 'MoE models whose update pass replays routing',
           "Fraction of the update pass's (token, layer) that took replayed experts instead of routing on their "
           'own.'),
    Metric('moe/rollout_agreement', 'fraction', 'training.routing_replay',
           'MoE models whose engine returns its routing',
           "Fraction of (token, layer) whose experts chosen by the trainer's router in the unperturbed old-policy "
           'pass are the same set the rollout engine chose.'),
    Metric('moe/update_flip_frac', 'fraction', 'training.routing_replay', 'MoE models (old-policy pass ran)',
           'Fraction of (token, layer) whose experts used in the update pass differ from those used by the old-'
           'policy pass (0 under perturbation.moe_routing: fixed).'),
    Metric('offload/bytes_freed', 'bytes', 'training.offload',
           'an offloader (GPUs, colocated) or trainer.phase_ledger',
           'Bytes of Megatron GPU storage released (weights, gradient buffers, optimizer state) by the phase '
           'moves, summed over the iteration.'),
    Metric('offload/bytes_moved', 'bytes', 'training.offload',
           'an offloader (GPUs, colocated) or trainer.phase_ledger',
           'Bytes copied from GPU to host memory (weights and optimizer state; gradients are dropped, not copied) '
           'by the phase moves, summed over the iteration.'),
    Metric('offload/seconds', 'seconds', 'training.offload', 'an offloader (GPUs, colocated) or trainer.phase_ledger',
           "Wall time spent offloading Megatron state, summed over the iteration's phase entries."),
    Metric('ratio/max', 'ratio', 'training.step_metrics', 'every iteration',
           "Maximum (max over the iteration's steps) of the per-token ratio pi_train / pi_rollout over a step's "
           'loss tokens on all DP ranks, pi_train being the forward the loss used (perturbed for ALP).'),
    Metric('ratio/min', 'ratio', 'training.step_metrics', 'every iteration',
           "Minimum (min over the iteration's steps) of the per-token ratio pi_train / pi_rollout over a step's "
           'loss tokens on all DP ranks, pi_train being the forward the loss used (perturbed for ALP).'),
    Metric('ratio/p2', 'ratio', 'training.step_metrics', 'every iteration',
           "2nd percentile of the per-token ratio pi_train / pi_rollout over a step's loss tokens on all DP ranks,"
           " pi_train being the forward the loss used (perturbed for ALP); mean over the iteration's steps."),
    Metric('ratio/p5', 'ratio', 'training.step_metrics', 'every iteration',
           "5th percentile of the per-token ratio pi_train / pi_rollout over a step's loss tokens on all DP ranks,"
           " pi_train being the forward the loss used (perturbed for ALP); mean over the iteration's steps."),
    Metric('ratio/p50', 'ratio', 'training.step_metrics', 'every iteration',
           "Median of the per-token ratio pi_train / pi_rollout over a step's loss tokens on all DP ranks, "
           "pi_train being the forward the loss used (perturbed for ALP); mean over the iteration's steps."),
    Metric('ratio/p95', 'ratio', 'training.step_metrics', 'every iteration',
           "95th percentile of the per-token ratio pi_train / pi_rollout over a step's loss tokens on all DP "
           "ranks, pi_train being the forward the loss used (perturbed for ALP); mean over the iteration's steps."),
    Metric('ratio/p98', 'ratio', 'training.step_metrics', 'every iteration',
           "98th percentile of the per-token ratio pi_train / pi_rollout over a step's loss tokens on all DP "
           "ranks, pi_train being the forward the loss used (perturbed for ALP); mean over the iteration's steps."),
    Metric('ratio_loss/p2', 'ratio', 'training.step_metrics', 'every iteration',
           '2nd percentile of the importance ratio the objective itself used (per loss token, or per sequence for '
           "sequence-level losses, before clipping) over a step's mini-batch on all DP ranks; mean over the "
           "iteration's steps."),
    Metric('ratio_loss/p98', 'ratio', 'training.step_metrics', 'every iteration',
           '98th percentile of the importance ratio the objective itself used (per loss token, or per sequence for'
           " sequence-level losses, before clipping) over a step's mini-batch on all DP ranks; mean over the "
           "iteration's steps."),
    Metric('reload/bytes_moved', 'bytes', 'training.offload',
           'an offloader (GPUs, colocated) or trainer.phase_ledger',
           'Bytes copied back from host to GPU (gradients come back as zeros, uncounted), summed over the '
           "iteration's phase entries."),
    Metric('reload/seconds', 'seconds', 'training.offload', 'an offloader (GPUs, colocated) or trainer.phase_ledger',
           "Wall time spent reloading Megatron state onto the GPU, summed over the iteration's phase entries."),
    Metric('response/masked_truncated_frac', 'fraction', 'trainer.metrics', 'every iteration',
           'Fraction of responses cut by the length limit that were taken out of the loss (= '
           'response/truncated_frac with loss.mask_truncated, else 0).'),
    Metric('response/truncated_frac', 'fraction', 'trainer.metrics', 'every iteration',
           "Fraction of the batch's responses with finish_reason 'length' (cut by the length limit)."),
    Metric('response_length/max', 'tokens', 'trainer.metrics', 'every iteration',
           'Longest response (response tokens, incl. tool-output tokens in TIR) in the trained batch.'),
    Metric('response_length/mean', 'tokens', 'trainer.metrics', 'every iteration',
           "Mean response length in tokens over the trained batch's trajectories."),
    Metric('reward/mean', '', 'trainer.metrics', 'every iteration',
           "Mean final reward (overlong penalty included) over the trained batch's trajectories."),
    Metric('reward/overlong_penalty_mean', '', 'trainer.metrics', 'every iteration',
           'Mean (non-positive) DAPO soft overlong penalty per trajectory of the trained batch (0 when '
           'reward.overlong_buffer = 0).'),
    Metric('reward/std', '', 'trainer.metrics', 'every iteration',
           "Standard deviation (unbiased) of the final reward over the trained batch's trajectories (0 for a "
           'single trajectory).'),
    Metric('rollout/replica_tokens_per_s_max', 'tokens/s', 'rollout.distributed',
           'every iteration in which a replica generated',
           "Fastest rollout replica's generated response tokens per second of its generation time, over the "
           'generate calls since the last record.'),
    Metric('rollout/replica_tokens_per_s_mean', 'tokens/s', 'rollout.distributed',
           'every iteration in which a replica generated',
           'Mean over busy replicas of response tokens per second of generation time.'),
    Metric('rollout/replica_tokens_per_s_min', 'tokens/s', 'rollout.distributed',
           'every iteration in which a replica generated',
           "Slowest replica's response tokens per second of generation time."),
    Metric('rollout/replicas', 'count', 'rollout.distributed', 'every iteration',
           'Configured number of rollout engine replicas.'),
    Metric('rollout/replicas_live', 'count', 'rollout.distributed', 'every iteration',
           'Replicas not retired (a replica failing twice in a row is retired).'),
    Metric('rollout/response_tokens', 'tokens', 'batches.sources', 'every iteration',
           'Response tokens generated for the iteration: on-policy summed over the first batch and every dynamic-'
           'sampling round (dropped groups included); generated ahead (max_staleness > 0), the tokens of the '
           'collected batch after stale groups were regenerated.'),
    Metric('rollout/straggler_ratio', 'ratio', 'rollout.distributed', 'every iteration in which a replica generated',
           'Slowest / mean generation time over the live replicas since the last record (1 = no straggler).'),
    Metric('sigma/mean', '', 'training.perturbation', 'perturbation.enabled',
           "Mean over all perturbation sites of each site's mean sigma (noise std added to the layer's input "
           "hidden states), after this iteration's updates, merged over pipeline stages."),
    Metric('sigma/{site}/max', '', 'training.perturbation', 'perturbation.enabled',
           "Largest sigma element of one perturbation site after this iteration's updates (equals the others for "
           'perturbation.shape: scalar; over hidden dims for vector).'),
    Metric('sigma/{site}/mean', '', 'training.perturbation', 'perturbation.enabled',
           "Mean sigma element of one perturbation site after this iteration's updates (equals the others for "
           'perturbation.shape: scalar; over hidden dims for vector).'),
    Metric('sigma/{site}/min', '', 'training.perturbation', 'perturbation.enabled',
           "Smallest sigma element of one perturbation site after this iteration's updates (equals the others for "
           'perturbation.shape: scalar; over hidden dims for vector).'),
    Metric('staleness/max', 'iterations', 'trainer.metrics', 'every iteration',
           "Largest (iteration - policy_version) over the batch's trajectories: weight versions between the "
           'generating and the trained weights (0 when on-policy).'),
    Metric('staleness/mean', 'iterations', 'trainer.metrics', 'every iteration',
           "Mean (iteration - policy_version) over the batch's trajectories (0 when on-policy)."),
    Metric('staleness/multi_version_frac', 'fraction', 'trainer.metrics', 'rollout.partial_rollout',
           'Fraction of trajectories generated under more than one weight version (spans continued across a weight'
           ' update).'),
    Metric('staleness/regenerated_groups', 'count', 'batches.sources', 'trainer.max_staleness > 0',
           'Groups generated ahead whose weights were more than trainer.max_staleness versions old and were '
           'generated again now.'),
    Metric('step', 'count', 'trainer.trainer', 'every record',
           "Optimizer steps taken so far, after this iteration's updates (trainer.updates_per_iteration per "
           'iteration); 0 in the iteration -1 base-validation record.'),
    Metric('sync/anchor', 'flag', 'sync.sources', 'rollout.sync_delta',
           'rollout.sync_delta: 1 when the last stream of the sync was a full one (an anchor: every '
           'rollout.sync_delta_anchor syncs, after an engine restart, a resume or a checksum mismatch), else 0.'),
    Metric('sync/bytes', 'bytes', 'sync.weight_sync', 'every iteration',
           "Bytes handed to an engine by the iteration's weight sync (full HF weights, the PEFT adapter with "
           'lora.sync: adapter, or the tensors that changed with rollout.sync_delta), summed over the streams of '
           'the sync (a retry or a full sync after a failed check adds its own), the replica that took most.'),
    Metric('sync/changed_frac', 'fraction', 'sync.sources', 'rollout.sync_delta',
           'rollout.sync_delta: share of the model\'s elements whose bits changed since the last sync (in the '
           'dtype compared: the engine\'s where it only casts); 1 when the sync was a full one.'),
    Metric('sync/delta_bytes', 'bytes', 'sync.sources', 'rollout.sync_delta',
           'rollout.sync_delta: bytes that reached the first replica leader from the trainer ranks in the last '
           'stream: positions and values of the changes (whole shards where that is smaller), the whole model '
           'in a full sync.'),
    Metric('sync/delta_s', 'seconds', 'sync.sources', 'rollout.sync_delta',
           'rollout.sync_delta: seconds rank 0 spent comparing its shards with their snapshots and encoding '
           'the changes (taking the snapshot, in a full sync).'),
    Metric('sync/gbps', 'GB/s', 'sync.weight_sync', 'every iteration',
           'Sync throughput: sync/bytes / sync/seconds / 1e9 (decimal gigabytes per second).'),
    Metric('sync/seconds', 'seconds', 'sync.weight_sync', 'every iteration',
           'Wall time of the weight sync to the engines (retries and verification included), excluding the wait '
           'for busy producers.'),
    Metric('sync/tensors', 'count', 'sync.weight_sync', 'every iteration',
           'Number of tensors streamed to an engine by the weight sync.'),
    Metric('sync/verify_max_abs_diff', 'nats', 'sync.weight_sync', 'rollout.verify_sync',
           'Max |engine - trainer| token logprob on the post-sync verification probe, of the worst replica '
           '(largest mean).'),
    Metric('sync/verify_mean_abs_diff', 'nats', 'sync.weight_sync', 'rollout.verify_sync',
           'Mean |engine - trainer| token logprob on the post-sync verification probe, worst replica.'),
    Metric('sync/wait_s', 'seconds', 'sync.weight_sync', 'every iteration',
           "Seconds the weight sync waited for the engines' producers to finish (or pause) a running generation "
           '(~0 when synchronous).'),
    Metric('throughput/rollout_tokens_per_s', 'tokens/s', 'trainer.metrics', 'every iteration',
           'rollout/response_tokens / timing/rollout_s: generated tokens per second of rollout time.'),
    Metric('throughput/tokens_per_s', 'tokens/s', 'trainer.metrics', 'every iteration',
           'Prompt + response tokens of the whole trained batch / timing/total_s.'),
    Metric('timing/calibration_s', 'seconds', 'trainer.phases',
           'calibration iterations (perturbation.init_std: auto)',
           'Wall time of the sigma calibration (layer-input RMS pass and perturbed search passes).'),
    Metric('timing/layer_probe_s', 'seconds', 'trainer.phases',
           'calibration iterations, perturbation.calibration_mode: per_layer or per_layer_added',
           "Wall time of the per-layer probe comparing the engine's and Megatron's layer inputs."),
    Metric('timing/old_logprob_s', 'seconds', 'trainer.phases', 'every iteration',
           'Wall time of the unperturbed old-policy logprob pass (~0 when it does not run).'),
    Metric('timing/ref_logprob_s', 'seconds', 'trainer.phases', 'every iteration',
           'Wall time of the reference-policy logprob pass (~0 without a reference, loss.kl_coef = 0).'),
    Metric('timing/reward_s', 'seconds', 'batches.sources', 'every iteration',
           'Wall time of reward scoring (rank 0, broadcast to all ranks), summed over dynamic-sampling rounds.'),
    Metric('timing/rollout_s', 'seconds', 'batches.sources', 'every iteration',
           'Generation time of the batch: wall time of sampling (on-policy, summed over rounds; TIR code execution'
           " included), or the slowest replica's generation time of the batch generated ahead plus regeneration "
           '(max_staleness > 0).'),
    Metric('timing/rollout_wait_s', 'seconds', 'batches.sources', 'trainer.max_staleness > 0',
           'Seconds the trainer blocked waiting to collect its batch generated ahead.'),
    Metric('timing/sync_s', 'seconds', 'trainer.phases', 'every iteration',
           'Wall time of the weight-sync phase as the trainer sees it (incl. waiting and verification).'),
    Metric('timing/total_s', 'seconds', 'trainer.trainer', 'every iteration',
           'Wall time of the training iteration from its start to after the weight sync (validation excluded).'),
    Metric('timing/update_s', 'seconds', 'trainer.phases', 'every iteration',
           'Wall time of the policy-update phase (all optimizer steps of the iteration).'),
    Metric('timing/val_s', 'seconds', 'trainer.trainer', 'validation records',
           'Wall time of the validation run (generation and scoring of data.val_files).'),
    Metric('tir/executions_mean', 'count', 'tir.multi_turn', 'tir.enabled',
           'Mean code executions per episode (trajectory) in the trained batch.'),
    Metric('tir/max_turns_frac', 'fraction', 'tir.multi_turn', 'tir.enabled',
           'Fraction of episodes that ended by hitting tir.max_turns (finish_reason max_turns).'),
    Metric('tir/status_frac/{status}', 'fraction', 'tir.multi_turn', 'tir.enabled (statuses that occurred)',
           "Share of the batch's code executions that ended with this sandbox status."),
    Metric('tir/turns_mean', 'count', 'tir.multi_turn', 'tir.enabled',
           'Mean model turns per episode in the trained batch.'),
    Metric('tir/used_tool_frac', 'fraction', 'tir.multi_turn', 'tir.enabled',
           'Fraction of episodes with at least one code execution.'),
    Metric('tir/void_turn_frac', 'fraction', 'tir.multi_turn', 'tir.enabled',
           'Void turns (neither code nor a final \\boxed{} answer) / all model turns in the batch.'),
    Metric('update/skipped', 'count', 'trainer.metrics', 'every iteration',
           'Optimizer steps of the iteration that Megatron skipped (update_ok false, e.g. non-finite gradients / '
           'fp16 overflow).'),
    Metric('val/pass@{k}', 'fraction', 'batches.evaluation', 'validation records',
           'Unbiased pass@k estimate (Chen et al.) from eval.k samples per problem, mean over problems, macro-'
           'averaged over validation files.'),
    Metric('val/reward_mean', 'fraction', 'batches.evaluation', 'validation records',
           'average@k: fraction of the eval.k samples per problem judged correct (reward > '
           'eval.correct_threshold), macro-averaged over validation files.'),
    Metric('val/{file}/pass@{k}', 'fraction', 'batches.evaluation', 'validation records (several data.val_files)',
           'pass@k of one validation file.'),
    Metric('val/{file}/reward_mean', 'fraction', 'batches.evaluation', 'validation records (several data.val_files)',
           'average@k of one validation file.'),
)


def metric_of(key: str) -> Optional[Metric]:
    """The catalogue's entry for ``key`` (a literal key before any pattern), or None."""
    exact = [m for m in METRICS if m.pattern == key]
    return exact[0] if exact else next((m for m in METRICS if m.matches(key)), None)


def metrics_table() -> str:
    """The catalogue as a Markdown table, by key."""
    rows = ["| key | unit | when | computed in | meaning |", "|---|---|---|---|---|"]
    for m in sorted(METRICS, key=lambda m: m.pattern):
        rows.append(f"| `{m.pattern}` | {m.unit} | {m.when} | `{m.module}` | {m.meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
