"""GcTuning (addons/gctuning.py): what is alive after start-up is frozen once, the young
generation is collected less often, and ``intercept_gc_tuning false`` keeps Python's defaults."""

from __future__ import annotations

import gc
import time

import pytest
from mitmproxy.test import taddons

from interceptor.addons import gctuning
from mitm import MitmProcess


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not tuned yet; the collector's state restored afterwards."""
    monkeypatch.setattr(gctuning, "_done", False)
    threshold = gc.get_threshold()
    yield gctuning.GcTuning()
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_is_frozen_once_and_young_collections_are_rarer(fresh):
    gc.unfreeze()
    with taddons.context(fresh):
        early = [1]
        fresh.running()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules, at least
        assert gc.get_threshold()[0] == gctuning.THRESHOLD0
        late = [2]  # what a flow allocates later is the collector's as usual
        fresh.running()  # a reloaded script runs ``running`` again: nothing more is frozen
        assert gc.get_freeze_count() == frozen
        seen = gc.get_objects()  # the frozen are out of the collector's sight
        assert not any(o is early for o in seen) and any(o is late for o in seen)


def test_off_keeps_the_defaults(fresh):
    gc.unfreeze()
    threshold = gc.get_threshold()
    with taddons.context(fresh) as tctx:
        tctx.configure(fresh, intercept_gc_tuning=False)
        fresh.running()
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold


def test_the_proxy_freezes_its_start_up():
    with MitmProcess() as proxy:
        deadline = time.time() + 120  # generous: the line follows start-up, a loaded machine is slow
        while "objects alive after start-up frozen" not in proxy.log() and time.time() < deadline:
            time.sleep(0.2)
        lines = [x for x in proxy.log().splitlines() if "objects alive after start-up frozen" in x]
        assert lines, proxy.log()[-2000:]
        line = lines[0]
        assert int(line.split("gc: ")[1].split()[0]) > 10_000  # mitmproxy and its libraries
