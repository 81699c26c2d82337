"""Transparent huge pages for the engine's large CPU tensors.

Every decode step streams the packed weights and reads each running session's K/V blocks, scattered over
the KV pool. On the kernel's default 4 KiB pages that is one TLB entry per 4 KiB: a 2,048-token session's
K/V (bf16, the packaged model) alone spans ~11,500 pages per step, and the hardware prefetchers stop at each
page's end. On 2 MiB pages the whole pool of a few hundred MB is a few hundred entries.

Linux hands out huge pages to anonymous memory either always or only where a range asks for them
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` / ``madvise`` / ``never``; most
distributions ship ``madvise``). :func:`advise_huge_pages` asks, per 2 MiB region that the tensors occupy:

* ``MADV_HUGEPAGE``, so the pages that are still unwritten (a fresh KV pool) are faulted in as huge pages;
* then ``MADV_COLLAPSE`` (Linux 6.1+), which copies already written pages (packed weights) into huge pages
  now rather than whenever the kernel's background scanner gets there. It fails on a region with nothing
  written yet, which is fine: the first advice covers those.

A pool's pages are then faulted in once, ahead of use (:func:`populate_in_background`): taking a huge page at
first write costs the kernel finding and zeroing 2 MiB, and a new session's first block touches one per layer,
K or V and KV head (180 for the packaged model), which would land in a step or in a new session's set-up; a
populated pool costs nothing there.

A region that the tensors share with other memory of the process is advised whole: that memory only gets
bigger pages. Where the system says ``never``, or the calls do not exist (not Linux, an old kernel), nothing
changes. The figures: docs/performance.md (the huge-pages benchmark, ``python -m benchmarks.huge_pages``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20
"""Tensors smaller than this are left alone (a huge page would be mostly other memory)."""
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_MADV_POPULATE_WRITE = 23
_MADV_DONTNEED = 4
POPULATE_CHUNK = 64 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP_ENABLED) -> str:
    """The system's transparent huge page mode: ``always``, ``madvise`` or ``never``; ``""`` where there is
    none to read (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


@dataclass(frozen=True)
class HugePageAdvice:
    regions: int
    """2 MiB regions advised (``MADV_HUGEPAGE`` accepted)."""
    collapsed: int
    """Of those, regions whose written pages were copied into a huge page at once (``MADV_COLLAPSE``)."""


_libc: ctypes.CDLL | None = None


def _madvise() -> Callable[[int, int, int], int] | None:
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = _libc.madvise
    return madvise


def advise_huge_pages(tensors: Iterable[torch.Tensor], *, min_bytes: int = MIN_BYTES) -> HugePageAdvice:
    """Ask for huge pages under the CPU memory of ``tensors`` (each of ``min_bytes`` or more; others, and
    tensors on other devices, are skipped). Never raises: a region the kernel refuses stays as it was."""
    madvise = _madvise()
    if madvise is None or thp_mode() in ("", "never"):
        return HugePageAdvice(0, 0)
    regions: set[int] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # an opaque tensor (a weight oneDNN prepacked) has no storage
            continue
        start, size = storage.data_ptr(), storage.nbytes()
        if size < min_bytes:
            continue
        regions.update(range(start // HUGE_PAGE, (start + size - 1) // HUGE_PAGE + 1))
    advised = collapsed = 0
    for region in sorted(regions):
        if madvise(region * HUGE_PAGE, HUGE_PAGE, _MADV_HUGEPAGE) != 0:
            continue
        advised += 1
        collapsed += madvise(region * HUGE_PAGE, HUGE_PAGE, _MADV_COLLAPSE) == 0
    return HugePageAdvice(advised, collapsed)


class Populating:
    """A daemon thread faulting a tensor's pages in (:func:`populate_in_background`); :meth:`stop` ends it
    after the chunk in progress."""

    def __init__(self, target: Callable[[threading.Event], None]) -> None:
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=target, args=(self._stopping,), name="chatd-populate", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        """Stop after the current chunk and wait for the thread (the memory may then be freed)."""
        self._stopping.set()
        self._thread.join()


def populate_in_background(tensor: torch.Tensor, *, chunk: int = POPULATE_CHUNK) -> Populating | None:
    """Fault in every page of ``tensor``'s CPU memory, writable, from a daemon thread (``MADV_POPULATE_WRITE``,
    Linux 5.14+, a chunk per call; the interpreter lock is free meanwhile). Contents are not touched, so the
    tensor may be in use all along. Between chunks the thread holds only a weak reference: once the tensor is
    gone (a pool replaced, a test's engine dropped) it stops, as it does when told to (:meth:`Populating.stop`,
    before the memory is released). Returns the thread's handle, or None where the call does not exist or the
    tensor is not on the CPU."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    start = storage.data_ptr() // 4096 * 4096
    end = storage.data_ptr() + storage.nbytes()
    alive = weakref.ref(tensor)

    def run(stopping: threading.Event) -> None:
        for offset in range(start, end, chunk):
            held = alive()  # kept through the call: the memory stays mapped while a chunk is populated
            if held is None or stopping.is_set():
                return
            failed = madvise(offset, min(chunk, end - offset), _MADV_POPULATE_WRITE) != 0
            del held
            if failed:
                log.debug("populating stopped: errno %d", ctypes.get_errno())
                return

    return Populating(run)


def release_pages(tensor: torch.Tensor) -> bool:
    """Give the physical pages under ``tensor``'s CPU memory back to the system now (``MADV_DONTNEED``: the
    mapping stays, and reads as zeros if touched again), for memory whose last owner may be freed only by a
    later garbage collection. Whether the call was made and accepted (not Linux, not the CPU: False)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // 4096) * 4096  # whole pages inside the tensor only: the rest is not ours
    end = (storage.data_ptr() + storage.nbytes()) // 4096 * 4096
    return end <= start or madvise(start, end - start, _MADV_DONTNEED) == 0


def huge_page_bytes(tensor: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of huge pages (``AnonHugePages``) in the process's mappings that overlap ``tensor``'s memory,
    0 where the system does not say (not Linux). For tests and start-up logs: a mapping may hold more than
    the tensor."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    total, overlaps = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
            lo, _, hi = head.partition("-")
            overlaps = int(lo, 16) < end and int(hi, 16) > start
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
