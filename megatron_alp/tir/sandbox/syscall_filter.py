"""The seccomp filter every execution runs under, compiled once per process with libseccomp.

An allow-list rather than a deny-list: a system call the kernel gains later is refused until it is
listed here, instead of being open by default. Calls outside the list fail with ``ENOSYS``, which
libc and CPython treat as "not on this kernel" and fall back from (``clone3`` to ``clone``,
``faccessat2`` to ``faccessat``); the usual starting points of kernel exploits and of state that
outlives an execution fail with ``EPERM`` so the refusal reads as one. Other architectures'
system-call ABIs (i386 and x32 calls from an x86-64 process) kill the process.

The program is generated here, in the trainer, and loaded by the confinement program
(:mod:`.confine`) with one ``prctl``: the sandboxed process needs neither libseccomp nor a
binding, and no per-execution compile.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

# What CPython, its standard library, numpy and sympy use, and nothing that reaches beyond the
# execution: file calls act inside its private mounts, IPC calls inside its own IPC namespace.
ALLOWED = (
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "msync", "mincore", "mlock", "mlock2",
    "munlock", "mlockall", "munlockall", "membarrier", "pkey_alloc", "pkey_free",
    "pkey_mprotect", "mseal", "map_shadow_stack",
    # files, directories, descriptors
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "creat", "close", "close_range", "lseek", "dup", "dup2", "dup3",  # open, openat: below
    "ftruncate", "truncate", "fallocate", "sendfile",
    "copy_file_range", "splice", "tee", "pipe", "pipe2", "ioctl",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat",
    "faccessat2", "readlink", "readlinkat", "getdents", "getdents64", "getcwd", "chdir", "fchdir",
    "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown",
    "fchownat", "umask", "utime", "utimes", "utimensat", "futimesat", "mknod", "mknodat",
    "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr", "setxattr", "lsetxattr",
    "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    # waiting, time, scheduling
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "timerfd_create", "timerfd_settime",
    "timerfd_gettime", "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday",
    "time", "times", "getitimer", "setitimer", "alarm", "timer_create", "timer_settime", "timer_gettime",
    "timer_getoverrun", "timer_delete", "pause", "futex", "futex_waitv", "set_robust_list",
    "get_robust_list", "restart_syscall", "sched_yield", "sched_getaffinity",
    "sched_getparam", "sched_setparam", "sched_getscheduler", "sched_setscheduler", "sched_getattr",
    "sched_setattr", "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
    "getpriority", "setpriority", "getcpu", "getrandom",
    # signals
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4", "kill", "tkill",
    "tgkill", "pidfd_open", "pidfd_send_signal",
    # processes and threads (clone: see the rules below)
    "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid", "set_tid_address",
    "rseq", "arch_prctl", "prctl", "getpid", "getppid", "gettid", "getpgid", "getpgrp", "getsid",
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
    "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups", "capget",
    "capset", "getrlimit", "setrlimit", "prlimit64", "getrusage", "sysinfo", "uname",
    # System V semaphores (semget: below) and POSIX IPC (private to the execution's IPC namespace)
    "shmdt", "shmctl", "semop", "semtimedop", "semctl", "msgsnd", "msgrcv", "msgctl", "mq_open",
    "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr",
    # sockets (socket() and socketpair(): Unix domain only, and only under a memory cgroup, below)
    "bind", "connect", "listen", "accept", "accept4", "getsockname", "getpeername",
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "setsockopt",
    "getsockopt",
)

# Refused with EPERM: kernel keyrings (state that outlives the process), namespaces and mounts,
# tracing and other processes' memory, the kernel's larger attack surfaces (bpf, io_uring,
# userfaultfd, perf), system administration, and leaving the execution's process group.
DENIED = (
    "keyctl", "add_key", "request_key", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "ptrace",
    "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "io_setup", "io_submit", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "quotactl", "quotactl_fd", "syslog", "open_by_handle_at", "name_to_handle_at", "fanotify_init",
    "fanotify_mark", "lookup_dcookie", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "vhangup", "personality", "modify_ldt", "uselib",
    "mbind", "set_mempolicy", "migrate_pages", "move_pages", "sync", "syncfs", "seccomp",
    "setsid", "setpgid",
    # host state shared through the read-only views of host files: page-cache residency and
    # eviction (a channel between executions, and disk reads no limit counts), locks (they block
    # host writers), change notifications (host activity); and leaving the execution's cores
    "fadvise64", "readahead", "flock", "inotify_init", "inotify_init1", "inotify_add_watch",
    "inotify_rm_watch", "sched_setaffinity",
    # System V shared memory and message queues: memory outside every process's address space
    # (so outside RLIMIT_AS), which the unsafe mode would also leave on the host
    "shmget", "shmat", "msgget",
)

# Disk flushes succeed without reaching the kernel: the only files the code can write are its own
# tmpfs's, where a flush does nothing, while on the read-only views of host files each one is a
# cache flush of the host's disk that no limit counts.
NO_OPS = ("fsync", "fdatasync", "sync_file_range")
O_DIRECT = getattr(os, "O_DIRECT", 0x4000)  # reads past the page cache: disk reads no limit counts
F_SETFL = 4

# fcntl commands allowed (descriptor flags, owners, signals, pipe sizes, seals, hints), and those
# refused with EPERM for the reasons above: record locks (classic and open-file description),
# leases and directory change notification. Others get the default (ENOSYS).
ALLOWED_FCNTL = (0, 1, 2, 3, 8, 9, 10, 11, 15, 16, 17, 1030, 1031, 1032, 1033, 1034, 1035, 1036, 1037, 1038)
DENIED_FCNTL = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026, 1029)  # F_GETLK, F_SETLK(W), F_OFD_*, leases, F_NOTIFY
# madvise advice allowed, and refused with EPERM: read-ahead and reclaim of file pages
# (page-cache probes and eviction).
ALLOWED_MADVISE = (0, 1, 2, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 22, 23, 24, 25, 102, 103)
DENIED_MADVISE = (3, 20, 21)  # MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT

CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
AF_UNIX = 1


@functools.lru_cache(maxsize=None)
def compile_filter(memory_cgroup: bool) -> bytes:
    """The filter as a classic BPF program (``struct sock_filter`` array) for the native
    architecture; raises :class:`RuntimeError` naming what is missing if libseccomp is not there.
    ``memory_cgroup``: a memory cgroup counts everything the execution pins, so memfd, System V
    semaphores and Unix sockets are allowed; without one they are refused with ``EPERM``."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError) as err:  # pyseccomp raises RuntimeError without libseccomp
        raise RuntimeError(f"libseccomp is unavailable ({err}): install the libseccomp2 system package "
                           "and the pyseccomp Python package") from None

    f = sc.SyscallFilter(sc.ERRNO(errno.ENOSYS))
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)

    def add(action: int, name: str, *args) -> None:
        nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if nr != -1:  # -1: newer than this libseccomp, so its default (ENOSYS) applies
            f.add_rule(action, nr, *args)

    for name in ALLOWED:
        add(sc.ALLOW, name)
    for name in DENIED:
        add(sc.ERRNO(errno.EPERM), name)
    for name in NO_OPS:
        add(sc.ERRNO(0), name)
    for name, flags in (("open", 1), ("openat", 2)):
        add(sc.ALLOW, name, sc.Arg(flags, sc.MASKED_EQ, O_DIRECT, 0))
        add(sc.ERRNO(errno.EPERM), name, sc.Arg(flags, sc.MASKED_EQ, O_DIRECT, O_DIRECT))
    # openat2 stays at the default (ENOSYS): its flags sit behind a pointer, and libc never needs it
    add(sc.ALLOW, "fcntl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, F_SETFL), sc.Arg(2, sc.MASKED_EQ, O_DIRECT, 0))
    add(sc.ERRNO(errno.EPERM), "fcntl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, F_SETFL),
        sc.Arg(2, sc.MASKED_EQ, O_DIRECT, O_DIRECT))
    ns_mask = sum(CLONE_NAMESPACE_FLAGS)
    add(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, ns_mask, 0))
    for flag in CLONE_NAMESPACE_FLAGS:
        add(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 stays at the default (ENOSYS): its flags sit behind a pointer, and libc falls back to clone
    # kernel memory that no limit counts without a memory cgroup: Unix socket buffers and datagram
    # backlogs, System V semaphore arrays, memfd pages (pipes: the kernel bounds them per uid)
    for name in ("socket", "socketpair"):
        add(sc.ALLOW if memory_cgroup else sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.EQ, AF_UNIX))
        add(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.NE, AF_UNIX))
    # int arguments: the kernel reads only their low 32 bits, so the rules compare those
    for name, arg, allowed, refused in (("fcntl", 1, ALLOWED_FCNTL, DENIED_FCNTL),
                                        ("madvise", 2, ALLOWED_MADVISE, DENIED_MADVISE)):
        for action, values in ((sc.ALLOW, allowed), (sc.ERRNO(errno.EPERM), refused)):
            for value in values:
                add(action, name, sc.Arg(arg, sc.MASKED_EQ, 0xFFFFFFFF, value))
    # preadv2/pwritev2 flags (RWF_NOWAIT probes the page cache): none at all
    for name in ("preadv2", "pwritev2"):
        add(sc.ALLOW, name, sc.Arg(5, sc.EQ, 0))
        add(sc.ERRNO(errno.EPERM), name, sc.Arg(5, sc.NE, 0))
    for name in ("memfd_create", "semget"):
        add(sc.ALLOW if memory_cgroup else sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
