"""Removing a directory tree that untrusted code wrote (the unsafe mode's working directories;
isolated executions write only to a tmpfs that goes away with their mount namespace).

Never follows a symbolic link: each directory is opened relative to its parent's descriptor with
``O_NOFOLLOW``, and anything that is not a directory is unlinked, never entered or ``chmod``-ed.
Never recurses: the walk is a loop holding at most three descriptors, so neither a deep tree nor a
full descriptor table stops it; climbing back through ``..`` is checked against the device and
inode recorded on the way down. A directory the code made unreadable is opened with ``O_PATH`` and
made accessible through ``/proc/self/fd``, which changes that directory and nothing it points to.
The processes that wrote the tree must be dead first: nothing here races a writer.
"""

from __future__ import annotations

import os
import stat
import time

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_BATCH = 1024


def _make_accessible(fd: int) -> None:
    os.chmod(f"/proc/self/fd/{fd}", 0o700)


def _open_dir(parent_fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            _make_accessible(handle)
        finally:
            os.close(handle)
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def _clear_files(fd: int, deadline: float):
    """Unlink everything in the directory ``fd`` but subdirectories; return one of those, or None
    once the directory is empty."""
    while True:
        if time.monotonic() >= deadline:
            raise TimeoutError
        with os.scandir(fd) as it:
            batch = [(e.name, e.is_dir(follow_symlinks=False)) for _, e in zip(range(_BATCH), it)]
        if not batch:
            return None
        for name, is_dir in batch:
            if is_dir:
                return name
            try:
                os.unlink(name, dir_fd=fd)
            except PermissionError:  # a directory without write permission (as a non-root owner)
                _make_accessible(fd)
                os.unlink(name, dir_fd=fd)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def remove_tree(path: str, timeout_s: float) -> bool:
    """Remove ``path`` (a directory, or anything else) and all under it. Returns False when that
    did not finish within ``timeout_s`` or the tree changed under the walk: what is left stays, and
    it is never an exception."""
    deadline = time.monotonic() + timeout_s
    parent, name = os.path.split(os.path.abspath(path))
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=fd)
            return True
        names, parents = [], []  # the walk's current path below ``parent``, and each level's parent
        sub = name
        while True:
            if sub is not None:  # go down
                child = _open_dir(fd, sub)
                parents.append(_identity(fd))
                names.append(sub)
                os.close(fd)
                fd = child
            else:  # ``fd`` is empty: go up and remove it
                up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = up
                if _identity(fd) != parents.pop():
                    return False
                try:
                    os.rmdir(names[-1], dir_fd=fd)
                except PermissionError:  # its parent is not writable (as a non-root owner)
                    _make_accessible(fd)
                    os.rmdir(names[-1], dir_fd=fd)
                names.pop()
                if not names:
                    return True
            sub = _clear_files(fd, deadline)
    except OSError:  # also TimeoutError
        return False
    finally:
        os.close(fd)
