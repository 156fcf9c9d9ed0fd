"""The `data` section: the prompt files and how rows become prompts."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from megatron_alp.config.base import _Section


class DataConfig(_Section):
    """Prompt data sets (parquet or jsonl)."""

    train_files: list[str] = Field(
        default_factory=list, description="Training prompt files (.parquet, .jsonl); read in order."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation prompt files.")
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a chat message list (system+user) or a plain string.",
    )
    answer_key: str = Field(
        "reward_model.ground_truth",
        description="Column holding the ground truth; dotted paths reach into nested columns.",
    )
    system_prompt: Optional[str] = Field(
        "Please reason step by step, and put your final answer within \\boxed{}.",
        description="System instruction added when a prompt has no system message (null: none). With "
        "`tir.enabled` and this key unset, the TIR instruction is used instead (megatron_alp.config."
        "TIR_SYSTEM_PROMPT: it describes the ```python and ```output blocks), so the model knows the interpreter.",
    )
    replace_system_prompt: bool = Field(
        False,
        description="Also replace the system message a prompt already has with `system_prompt` (e.g. to "
        "give single-turn data the TIR instruction); false keeps the data's own.",
    )
    max_train_prompts: Optional[int] = Field(
        None, ge=1, description="RL trains on only the first N usable training prompts (null: all of them), "
        "e.g. for a quick run on a fixed pool or an overfitting check. The tiny-model warm start "
        "(`trainer.sft_warmup_steps`) still reads every training prompt.",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip the rows of data files that cannot be used (a line that is not a JSON object, an empty "
        "or malformed prompt, no ground truth) and report how many and where (file:line), instead of refusing "
        "the file at the first one. Prompts longer than `rollout.sampling.max_prompt_length` are always left out "
        "and reported.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (deterministic in `seed`).")
    seed: int = Field(1, description="Data shuffling seed.")
