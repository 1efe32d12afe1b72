"""The OS's name for a thread, so ``top -H``, ``ps -L`` and /proc/<pid>/task/<tid>/comm tell inferd's threads apart.

Python keeps a thread's name to itself; the OS knows every Python thread as "python" (or the interpreter's name).
Naming a worker thread at its start also names the compute threads it starts afterwards (a new Linux thread takes
its creator's name): torch's OpenMP team for that thread, so a model's live and background work and their pools read
apart (bench/batch_jobs.py splits a condition's CPU by these names).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15
NAME_BYTES = 15  # the kernel's limit, without the terminating zero

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # no libc to call: threads keep the interpreter's name
        _libc = None


def name_os_thread(name: str) -> bool:
    """Name the calling thread for the OS (cut to 15 bytes); whether it took (Linux only)."""
    if _libc is None:
        return False
    return _libc.prctl(PR_SET_NAME, name.encode()[:NAME_BYTES], 0, 0, 0) == 0
