"""The sandboxed Python interpreter of tool-integrated reasoning: it runs model-written code, so it
is built to hold against code written to escape it.

Every execution is a fresh interpreter in its own Linux namespaces (mount, PID, network, IPC, UTS,
cgroup; and a user namespace where the trainer is not root) with a private read-only root file
system, a size-limited tmpfs as its only writable place, an unprivileged uid without capabilities,
``no_new_privs``, a seccomp allow-list and resource limits; nothing it creates outlives it. Where
that is not available the executor refuses to start, unless ``tir.sandbox.allow_unsafe`` asks for
an unsafe mode meant for local debugging. ``docs/sandbox.md`` says what each mode guarantees.

The project builds the namespaces itself rather than through bubblewrap: as root, bubblewrap
either keeps the code at uid 0 (without a user namespace) or maps it to uid 0 of the host (with
one), while :mod:`.confine` builds them with root's privileges and then runs the code as an
unprivileged uid of its own, one per worker slot. Without root it needs exactly what bubblewrap
needs (unprivileged user namespaces). The seccomp filter is libseccomp's, generated once in the
trainer (:mod:`.syscall_filter`) and loaded by the confined process, as bubblewrap's ``--seccomp``
does.

Modules: :mod:`.executor` (the trainer's side: :class:`SandboxExecutor`), :mod:`.confine` (the
program each execution runs to confine itself), :mod:`.syscall_filter` (the seccomp policy),
:mod:`.cgroup` (the memory cgroup of each execution), :mod:`.cleanup` (removing trees untrusted
code wrote, for the unsafe mode).
"""

from megatron_alp.tir.sandbox.executor import ExecutionResult, SandboxExecutor, SandboxUnavailableError

__all__ = ["ExecutionResult", "SandboxExecutor", "SandboxUnavailableError"]
