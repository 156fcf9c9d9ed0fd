"""The `tir` section and its `tir.sandbox`: multi-turn tool-integrated reasoning and the interpreter it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_alp.config.base import _Section


class SandboxConfig(_Section):
    """Limits of the Python interpreter used in tool-integrated reasoning. Each execution runs in
    its own process, isolated by Linux namespaces, seccomp and an unprivileged uid; without them
    training refuses to start unless `allow_unsafe` is set (see docs/sandbox.md)."""

    cpu_time_s: float = Field(5.0, gt=0.0, description="CPU seconds per execution (rounded up to whole seconds).")
    wall_time_s: float = Field(
        10.0, gt=0.0, description="Wall-clock seconds per execution; then every process it started is killed."
    )
    memory_mb: int = Field(1024, ge=16, description="Address-space limit per execution (MiB).")
    max_output_bytes: int = Field(
        8192, ge=64, description="Output kept per execution (bytes); longer output keeps its head and tail "
        "around a truncation marker, and an execution that prints 64 times this much is stopped."
    )
    max_processes: int = Field(1, ge=1, description="Processes the executed code may have (1: no fork).")
    max_file_mb: int = Field(64, ge=1, description="Largest file the executed code may write (MiB).")
    workers: int = Field(8, ge=1, description="Executions run in parallel.")
    disk_mb: int = Field(
        64, ge=1, description="Size of the private tmpfs each execution writes to (its working directory and "
        "/tmp), in MiB; it takes memory, not disk, and disappears with the execution."
    )
    allow_unsafe: bool = Field(
        False,
        description="Run model-written code even where full isolation (namespaces, seccomp) is unavailable, "
        "instead of refusing to start. Local debugging only: the code then runs without namespaces or disk "
        "quota (never as uid 0) and can read the machine's files, reach local services and, unless the "
        "trainer runs as root, signal the trainer's processes.",
    )
    allow_no_memory_cgroup: bool = Field(
        False,
        description="Run fully isolated executions where no memory cgroup can be made for them (cgroup v2 "
        "without the memory controller delegated, cgroup v1 read-only), instead of refusing to start. Kernel "
        "memory is then bounded only by refusing what pins it (Unix sockets, System V semaphores, memfd): "
        "see docs/sandbox.md for what each mode bounds.",
    )


TIR_SYSTEM_PROMPT = (
    "Solve the problem step by step. You may write Python code in a ```python code block; it is "
    "executed and its output is shown to you in an ```output block. Use it to compute and check. "
    "Put your final answer within \\boxed{}."
)


class TIRConfig(_Section):
    """Multi-turn tool-integrated reasoning (paper section 4): the model writes ```python blocks,
    each is executed in the sandbox and its output appended as an ```output block."""

    enabled: bool = Field(False, description="Roll out multi-turn episodes with a Python interpreter.")
    max_turns: int = Field(
        5, ge=1, description="Code executions per episode; a further code block ends the episode unexecuted."
    )
    mask_void_turns: bool = Field(
        True,
        description="Exclude from the loss a turn the model ends with neither a code block nor a final "
        "\\boxed{} answer (turns cut by the length limit are not void).",
    )
    tool_format: Literal["inline", "chat"] = Field(
        "inline",
        description="How interpreter output enters the context: `inline` appends the ```output block in the "
        "assistant message (SimpleTIR, the paper's setup, for base models); `chat` closes the assistant "
        "message and adds a `tool` message rendered by the tokenizer's chat template.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
