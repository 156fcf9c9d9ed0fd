"""Remove the /dev/shm segments a process leaves behind when it ends, however it ends.

``python -S shm_janitor.py PID`` (standard library only, so it starts in milliseconds): while
process PID lives, note every /dev/shm file it maps; once it is gone, unlink those that no live
process maps any more. vLLM's processes share memory through anonymous ``psm_*`` segments that
only a clean exit of their creator unlinks; a process killed (by our own SIGKILL escalation, by
vLLM terminating its workers, or by a preemption) leaves them in /dev/shm until the machine
reboots. A segment another live process still maps is left to that process's own janitor. Only
segments at the top of /dev/shm are a janitor's: a file inside a folder there (the synced weights
of the folder transport, which an engine restarted after the kill reads again) belongs to whoever
made the folder.
Started by :func:`megatron_alp.runtime.process.clean_shared_memory_after`.
"""

import os
import sys
import time

SHM = "/dev/shm/"
POLL_S = 0.5


def mapped(pid: str) -> set[str]:
    """The segments at the top of /dev/shm that process ``pid`` maps (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            names = {line.split(SHM, 1)[1].split()[0] for line in maps if SHM in line}
    except OSError:
        return set()
    return {name for name in names if "/" not in name}


def running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def main(pid: str) -> None:
    seen: set[str] = set()
    while running(pid):
        seen |= mapped(pid)
        time.sleep(POLL_S)
    if not seen:
        return
    in_use = set()
    for other in os.listdir("/proc"):
        if other.isdigit() and other != str(os.getpid()):
            in_use |= mapped(other)
    for name in seen - in_use:
        try:
            os.unlink(SHM + name)
        except OSError:  # removed meanwhile, or not ours to remove
            pass


if __name__ == "__main__":
    main(sys.argv[1])
