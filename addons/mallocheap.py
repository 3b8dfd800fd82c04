"""MallocHeap: glibc reuses its heap for each turn's history-sized blocks instead of mapping
fresh pages for every one of them.

A growing rollout allocates, every turn, a few blocks the size of the whole history: the
request's bytes, its text, the body written anew, the message list's text kept to recognise
the next request (``trace/prefix.py``), the answer. glibc's malloc serves a block above its
mmap threshold (128 KiB at start) with ``mmap`` and unmaps it when it is freed; the threshold
then rises to the size of the block freed, and the trim threshold to twice that. So each
turn's block, a little bigger than the last turn's, is above the threshold again and mapped
anew: zero-filled pages, each faulted in on first touch. Measured here (a Python process
making a slightly bigger 100-460 KB string each turn and keeping the last): 83-120 µs and 35-44
page faults a block, against 9-10 µs and 1 with both thresholds fixed at 32 MiB (mmap alone
fixed is not enough: the freed top of the heap is then trimmed and faulted in again). In
process (``bench/hooks.py``) and in the real one (``bench/rollout.py``) the figures are in
docs/benchmarks.md.

At ``running``, with ``intercept_malloc_heap`` MiB (32 by default, glibc's largest mmap
threshold on 64-bit): ``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)``, so a
block below it comes from the heap and a freed one stays there for reuse (a 100 MB body is
still mapped). Fixing them stops glibc's own adjustment. What the heap keeps is what
``MallocTrim`` gives back after sessions are sealed (``malloc_trim`` returns every whole free
page, wherever it is), so the resident set between waves is unchanged; while sessions are live
it may hold up to that much more freed memory at the heap's top. ``0``: glibc's defaults.
Not glibc (musl, macOS): nothing to call, nothing done.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from mitmproxy import ctx, exceptions

from interceptor.addons.malloctrim import glibc

log = logging.getLogger(__name__)

DEFAULT_MIB = 32
MAX_MIB = 32  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: a larger mmap threshold is refused
#: mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

_done = False  # per process: the thresholds are the process's, set once


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where there is none."""
    return glibc("mallopt", [ctypes.c_int, ctypes.c_int])


def keep_heap(mib: int) -> bool:
    """Blocks below ``mib`` MiB from the heap, and up to that much freed memory kept at its
    top; True if glibc took both."""
    mallopt = _mallopt()
    if mallopt is None or mib <= 0:
        return False
    size = mib << 20
    return bool(mallopt(M_MMAP_THRESHOLD, size)) and bool(mallopt(M_TRIM_THRESHOLD, size))


class MallocHeap:
    def load(self, loader) -> None:
        loader.add_option(
            "intercept_malloc_heap", int, DEFAULT_MIB,
            "MiB below which glibc's malloc serves blocks from its heap and keeps freed ones there for "
            "reuse (its mmap and trim thresholds, set once at start), so a growing rollout's history-sized "
            f"blocks do not fault in fresh pages every turn; at most {MAX_MIB}; 0: glibc's defaults.")

    def configure(self, updated) -> None:
        if "intercept_malloc_heap" in updated:
            value = ctx.options.intercept_malloc_heap
            if not 0 <= value <= MAX_MIB:
                raise exceptions.OptionsError(f"intercept_malloc_heap must be 0 (off) to {MAX_MIB} MiB, got {value}")

    def running(self) -> None:
        global _done
        mib = ctx.options.intercept_malloc_heap
        if _done or mib <= 0:
            return
        _done = True
        if keep_heap(mib):
            log.info(f"interceptor: malloc: blocks below {mib} MiB from the heap, freed ones kept for reuse")
        elif _mallopt() is None:
            log.info("interceptor: malloc: no glibc mallopt here; the allocator's defaults stay")
        else:
            log.warning(f"interceptor: malloc: glibc refused a {mib} MiB threshold (mmap or trim)")
