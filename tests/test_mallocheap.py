"""MallocHeap (addons/mallocheap.py): with the thresholds set, a growing rollout's history-sized
blocks are served from glibc's heap and reused, not mapped and faulted in anew every turn;
``intercept_malloc_heap 0`` keeps glibc's defaults; a value glibc would refuse is refused; the
proxy sets them at start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from interceptor.addons import mallocheap
from mitm import MitmProcess

# A slightly bigger string each turn, the last one kept (what a growing history does): the
# page faults per block, in a process of its own (the thresholds are the process's).
GROWTH = """
import resource, sys
from interceptor.addons.mallocheap import keep_heap
took = keep_heap(int(sys.argv[1]))
base = "x" * 2_000_000
kept = []
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for turn in range(200):
    kept = [base[:100_000 + turn * 1200]]
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 200)
"""


def _faults(mib: int) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", GROWTH, str(mib)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    took, faults = out.stdout.split()
    return took == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or mallocheap._mallopt() is None, reason="glibc only")
def test_a_growing_block_reuses_the_heap_instead_of_faulting_in_fresh_pages():
    took, kept = _faults(32)
    off, default = _faults(0)
    assert took and not off
    assert kept < 3, kept  # the block before it, freed, is reused: no fresh pages
    assert default > 5 * max(kept, 1), (default, kept)  # glibc's defaults map every block anew


def test_off_and_out_of_range(monkeypatch):
    calls = []
    monkeypatch.setattr(mallocheap, "_done", False)
    monkeypatch.setattr(mallocheap, "keep_heap", lambda mib: calls.append(mib) or True)
    addon = mallocheap.MallocHeap()
    with taddons.context(addon) as tctx:
        for bad in (-1, mallocheap.MAX_MIB + 1):
            with pytest.raises(exceptions.OptionsError):
                tctx.configure(addon, intercept_malloc_heap=bad)
        tctx.configure(addon, intercept_malloc_heap=0)
        addon.running()
        assert calls == []  # glibc's defaults
        tctx.configure(addon, intercept_malloc_heap=16)
        addon.running()
        addon.running()  # a reloaded script: once per process
        assert calls == [16]


def test_the_proxy_keeps_its_heap():
    with MitmProcess() as proxy:
        deadline = time.time() + 120  # the line follows start-up; a loaded machine is slow
        while "interceptor: malloc:" not in proxy.log() and time.time() < deadline:
            time.sleep(0.2)
        assert "blocks below 32 MiB from the heap" in proxy.log(), proxy.log()[-2000:]
