"""The OS's names for inferd's threads (utils/threads.py): what top -H and /proc show, and what bench/batch_jobs.py
splits a server's CPU by."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from inferd.core.instances import Instance
from inferd.utils.threads import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from Linux's /proc")


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_named_thread_reads_so_in_proc_cut_to_the_kernels_fifteen_bytes() -> None:
    seen: dict[str, str] = {}

    def body(name: str) -> None:
        assert name_os_thread(name)
        seen[name] = _comm(threading.get_native_id())

    for name in ("inferd-bg", "inferd-a-very-long-thread-name"):
        thread = threading.Thread(target=body, args=(name,))
        thread.start()
        thread.join()
    assert seen == {"inferd-bg": "inferd-bg", "inferd-a-very-long-thread-name": "inferd-a-very-l"}


def test_a_thread_started_from_a_named_one_takes_its_name() -> None:
    """What names a worker's compute threads (its OpenMP team starts from the worker thread)."""
    seen: list[str] = []

    def child() -> None:
        seen.append(_comm(threading.get_native_id()))

    def parent() -> None:
        name_os_thread("inferd-7")
        inner = threading.Thread(target=child)
        inner.start()
        inner.join()

    thread = threading.Thread(target=parent)
    thread.start()
    thread.join()
    assert seen == ["inferd-7"]


@pytest.mark.parametrize(("background", "shadow", "label"),
                         [(False, False, "2"), (True, False, "bg"), (None, True, "shadow"), (None, False, "2")])
def test_each_kind_of_worker_has_its_short_name(background: bool | None, shadow: bool, label: str) -> None:
    """A live instance that takes background work too (``background_pauses: false``) is still a live instance."""
    instance = Instance("m", 2, threads=1, serves=lambda lane: True, background=background, shadow=shadow)
    assert instance.os_label == label
