"""The /dev/shm files a pulling rank hands its same-host sources to write into, kept and
reused across pulls.

tmpfs zeroes every page the first time it is written: a fresh 94 MB file for each pull of a
2,048-token SmolLM2 request cost as much as the copy itself, and made shared memory slower
than TCP (`python -m bench.kv_transfer`'s "plain shm" row, bench/results/kv_transfer.md). A
file whose pages are already there is written and read back at memory speed. So a process
keeps its files (one per pull running at once, each as large as the largest piece it
carried, up to `MAX_KEPT_BYTES`) and hands them out again; a file that a pull left in doubt
(failed) is dropped.

Files are named `pagemesh-kv-stage-<pid>-<n>`: a process killed with its files still there
leaves them, and the next process to stage anything removes those whose process is gone.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import threading

from worker_svc.kv_transfer.wire import SHM_DIR, SHM_PREFIX

MAX_KEPT_BYTES = 512 << 20  # a larger file is used once and removed
_STAGE = f"{SHM_PREFIX}stage-"
_NAME = re.compile(re.escape(_STAGE) + r"(\d+)-\d+$")


class StagingFiles:
    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._free: list[tuple[int, str, int]] = []  # (fd, path, size)
        self._numbers = itertools.count()
        self._swept = False
        atexit.register(self.close)

    def acquire(self, nbytes: int) -> tuple[int, str]:
        """An open file of at least `nbytes` (grown if needed) and its path; OSError when
        none can be made (no /dev/shm, or it is full)."""
        with self._lock:
            if not self._swept:
                self._swept = True
                _remove_orphans(self.directory)
            kept = self._free.pop() if self._free else None
        if kept is None:
            path = f"{self.directory}/{_STAGE}{os.getpid()}-{next(self._numbers)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            size = 0
        else:
            fd, path, size = kept
        if size < nbytes:
            try:
                os.ftruncate(fd, nbytes)
            except OSError:
                _drop(fd, path)
                raise
        return fd, path

    def release(self, fd: int, path: str, reusable: bool) -> None:
        """Back for the next pull, or removed (a failed pull's, or one too large to keep)."""
        size = os.fstat(fd).st_size if reusable else 0
        if not reusable or size > MAX_KEPT_BYTES:
            _drop(fd, path)
            return
        with self._lock:
            self._free.append((fd, path, size))

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for fd, path, _ in free:
            _drop(fd, path)


def _drop(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _remove_orphans(directory: str) -> None:
    """Staging files of processes that are gone (killed mid-life)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
