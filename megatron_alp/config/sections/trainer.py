"""The `trainer` section: the RL loop's sizes, schedule, checkpoints and logging."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from megatron_alp.config.base import _Section


class TrainerConfig(_Section):
    """The RL loop: sizes, lengths, checkpoints and logging."""

    output_dir: str = Field("runs/default", description="Run directory (checkpoints, metrics, plots).")
    iterations: int = Field(100, ge=1, description="RL iterations (rollout + updates + sync).")
    prompts_per_iteration: int = Field(512, ge=1, description="Prompts sampled per iteration.")
    updates_per_iteration: int = Field(
        16, ge=1, description="Optimizer steps per iteration (the batch is split into this many mini-batches)."
    )
    micro_batch_size: int = Field(
        4, ge=1, description="Sequences per micro-batch in a forward/backward (when no token budget is set)."
    )
    max_tokens_per_micro_batch: Optional[int] = Field(
        None,
        ge=1,
        description="Token budget of a policy-update micro-batch, in place of `micro_batch_size` rows: "
        "length-sorted padded rows while rows x longest row fit, or with `sequence_packing` sequences laid "
        "end to end in one row of at most this many tokens. Must hold the longest sequence (`rollout."
        "max_model_len`, default max prompt + max response). The loss normalisation stays exact (global "
        "token and sequence counts of the mini-batch).",
    )
    logprob_max_tokens_per_micro_batch: Optional[int] = Field(
        None,
        ge=1,
        description="Token budget of the old/reference logprob passes (default: `max_tokens_per_micro_batch`). "
        "They keep no activations for a backward, so a budget 2-4x the update's usually fits.",
    )
    sequence_packing: bool = Field(
        False,
        description="Pack several sequences into one row with per-sequence positions and no attention "
        "across sequences, so no pad token is computed (needs `max_tokens_per_micro_batch`). Transformer "
        "Engine attention gets Megatron's THD layout (cu_seqlens); the local spec a block-diagonal causal "
        "mask. Pipeline parallel pads the packed rows of a pass to one length; sequence parallel pads to "
        "a multiple of the tensor-parallel size.",
    )
    balance_data_parallel: bool = Field(
        True,
        description="Split each mini-batch over the data-parallel ranks by greedy LPT on the estimated cost "
        "of each sequence (tokens, plus attention's quadratic share) instead of equal contiguous counts. "
        "Logged: `batch/dp_imbalance` (max / mean cost per rank) and `batch/dp_imbalance_unbalanced`.",
    )
    fused_linear_logprobs: bool = Field(
        True,
        description="Compute the sampled-token logprobs and entropy from the final hidden states and the "
        "output weight chunk by chunk, never materialising the [tokens, vocab/TP] logits or their gradient "
        "(false: Megatron's output layer makes the logits, then the chunked logprob code reads them).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous off-policy training. 0: every iteration generates with the newest weights, "
        "then trains (synchronous). k >= 1 (needs `rollout.placement: separate`): the engines generate the "
        "next k batches while the trainer updates, and a batch is trained on only if the weights that "
        "generated it are at most k versions (iterations) old; older groups are regenerated and counted "
        "(`staleness/regenerated_groups`). Every trajectory records its policy version; `staleness/mean` and "
        "`staleness/max` are logged. ALP's single ratio is against the policy that generated the tokens, so "
        "staleness and engine mismatch are corrected by the same ratio.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop the GRPO groups that `dynamic_sampling_filter` rejects (by "
        "default those whose n answers are all correct or all wrong) and sample more prompts in extra rounds "
        "until the batch has `prompts_per_iteration` groups it keeps (the first ones, in sampling order). A "
        "round asks for the missing groups / the keep rate so far x 1.25 (at most 4 x `prompts_per_iteration` "
        "prompts), with per-sample seeds of (seed, iteration, round), so a resumed run replays it. After "
        "`dynamic_sampling_max_rounds` rounds a short batch is completed with dropped groups, never an error. "
        "Extra rounds draw from the data, so epochs end sooner. Logged: `dynamic_sampling/rounds`, "
        "`generated_groups`, `kept_frac` (groups kept / generated), `filled_groups` (dropped groups trained "
        "on) and `reward_mean` (all generated responses; `reward/mean` is the trained batch's). Needs "
        "`rollout.sampling.n` >= 2.",
    )
    dynamic_sampling_filter: Literal["correct", "reward"] = Field(
        "correct",
        description="The groups `dynamic_sampling` keeps. `correct` (DAPO): 0 < #correct < n, where a response "
        "is correct when the reward function gives it full credit (1.0) before the overlong punishment (for "
        "`math_verify`: the verifier accepts its last boxed answer; a TIR episode is judged by its final "
        "response); a group of correct answers whose rewards differ only through the punishment is dropped, "
        "and a kept group whose punished rewards happen to be equal trains with zero advantage "
        "(`batch/zero_variance_groups`). `reward`: the final rewards (punishment included) are not all equal, "
        "i.e. exactly the groups with a non-zero advantage.",
    )
    dynamic_sampling_max_rounds: int = Field(
        4, ge=0, description="Extra generation rounds per iteration allowed to `dynamic_sampling`."
    )
    seed: int = Field(1, description="Global seed (model init, sampling engine, data order).")
    save_interval: int = Field(10, ge=1, description="Save a checkpoint every this many iterations.")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    resume: bool = Field(
        True,
        description="Resume from the newest complete checkpoint in output_dir (a run that has none starts from the "
        "beginning). false: start a fresh run, which a directory an earlier run left files in refuses (its "
        "metrics and checkpoints would mix with the new run's) unless `archive_previous` is set.",
    )
    archive_previous: bool = Field(
        False,
        description="With `resume: false`: move what an earlier run left in output_dir (checkpoints, metrics, "
        "config, tiny base model, figures, tracker files) to output_dir/archive/<UTC time>/ before the fresh run "
        "starts.",
    )
    validate_base: bool = Field(
        True,
        description="With `eval_interval`: validate the base model before the first update too, logged as "
        "iteration -1 (the figures draw it at 0, where the validation curve starts).",
    )
    eval_interval: int = Field(
        0,
        ge=0,
        description="Validate every this many iterations and after the last (0: never): the run's rollout "
        "engine, holding the current (unperturbed) policy, samples `eval.k` answers per problem of "
        "`data.val_files` at `eval.temperature` and `eval.top_p`, with the same seeds every time; the "
        "iteration's metrics get `val/reward_mean` (average@k) and `val/pass@j` (j in `eval.pass_k`, up to "
        "k), per file too (`val/<file>/...`) when there are several. The reward figure draws them.",
    )
    loggers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers that get the run's config, every iteration's metrics, the figures and the "
        "final summary, beside RUN/metrics.jsonl (always written): `tensorboard` (RUN/tensorboard), `wandb` (needs "
        "`wandb_project`; `wandb_mode: offline` writes RUN/wandb), `mlflow` (`mlflow_tracking_uri`, default a file "
        "store in RUN/mlruns). A tracker whose package is missing is refused when the config is loaded, with the pip "
        "command.",
        json_schema_extra={"registry": "logger"},
    )
    tensorboard: bool = Field(
        True, description="TensorBoard in `loggers` (kept for configs that set it; false takes it out of `loggers`).")
    wandb_project: Optional[str] = Field(
        None, description="Weights & Biases project of the `wandb` logger (setting it alone adds `wandb` to `loggers`).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="Weights & Biases mode: `offline` keeps the run in RUN/wandb for `wandb sync` later.")
    mlflow_tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI of the `mlflow` logger (default: a file store in RUN/mlruns).")
    mlflow_experiment: str = Field("megatron-alp", description="MLflow experiment the run is logged under.")
    progress_bar: bool = Field(True, description="Show a progress bar with ETA on the console.")
    mismatch_metrics: bool = Field(
        True,
        description="Run the unperturbed old-policy logprob pass every iteration even when the loss "
        "does not need it, for the train-vs-rollout mismatch metrics and token-probability dumps.",
    )
    hang_deadline_s: Optional[float] = Field(
        3600.0,
        gt=0,
        description="A phase (rollout, logprob passes, update, weight sync, ...) that runs longer than this stops "
        "the rank: it writes RUN/hang/rank_<r>.json (its phase, and where every other rank's heartbeat stands, so "
        "the rank that did not arrive is named) with its threads' stacks, and exits 124, which the launch scripts "
        "requeue. A checkpoint save, a resume and the start's HF weights count only the time without progress "
        "(no more bytes written by the save's ranks, or read by the rank), so a slow shared storage is not a hang. "
        "null: wait forever.",
    )
    phase_ledger: bool = Field(
        False,
        description="Write what each rank holds at every phase entry (Megatron state measured from its storages, "
        "the engine memory awake; on GPUs the memory in use and the trainer's peak) to "
        "RUN/phase_ledger/rank_<r>.jsonl. The offload moves of rollout.offload_* then run on the CPU too, so a CPU "
        "run checks that the trainer follows the phase table (megatron_alp/trainer/phases.py); the GPU self-test "
        "compares the measured peaks with `megatron-alp plan`.",
    )
    token_prob_samples: int = Field(
        20000, ge=0, description="Token (train, rollout) probability pairs saved per iteration for plots."
    )
    sft_warmup_steps: int = Field(
        0,
        ge=0,
        description="Supervised warm-start steps on the training answers before RL (tiny models only: "
        "gives a random model a partial skill so rewards are not all zero).",
    )
    sft_warmup_lr: float = Field(3e-3, gt=0.0, description="Learning rate of the supervised warm start.")
    sft_warmup_unboxed: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the training prompts whose warm-start answer (format `answer`) leaves out "
        "the box (\"The answer is 7.\", which math_verify scores 0), chosen with `seed`: the model starts out "
        "forgetting the box about as often on every problem, and RL can learn to box on held-out ones too.",
    )
    sft_warmup_format: Literal["answer", "tir"] = Field(
        "answer",
        description="Target of the supervised warm start: `answer` is \"The answer is \\boxed{x}.\"; `tir` "
        "(needs `tir.enabled`) is an episode of the multi-turn format, token for token: a ```python block "
        "that computes the problem, the interpreter's ```output block (masked from the loss, as in RL), "
        "then the answer. `tir` reads the problem from prompts like data/digits' (\"What is 7 + 9?\").",
    )
