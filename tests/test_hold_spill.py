"""A held answer (addons/gateway/answer/hold.py) is kept in memory up to ``spill_bytes`` and
in a temporary file beyond; ``Held.spilled`` says which from the size the hold counted itself
(no private state of ``tempfile.SpooledTemporaryFile`` read). Checked against what the spill
file did, through the one attribute the tempfile documentation names for it: ``_file`` is an
``io.BytesIO`` until the file rolled over to disk
(https://docs.python.org/3/library/tempfile.html#tempfile.SpooledTemporaryFile)."""
from __future__ import annotations

import io
import itertools

import pytest

from interceptor.addons.gateway.answer.held import Held


def on_disk(held: Held) -> bool:
    return held.spill is not None and not isinstance(held.spill._file, io.BytesIO)


@pytest.mark.parametrize("spill_bytes", [0, 1, 16, 100])
@pytest.mark.parametrize("sizes", [(1,), (15, 1), (16,), (16, 1), (17,), (8, 0, 8, 1), (5, 5, 5, 5, 5), (200,)])
def test_spilled_is_what_the_spill_file_did(spill_bytes, sizes):
    held = Held(spill_bytes=spill_bytes)
    data = bytes(itertools.islice(itertools.cycle(range(256)), sum(sizes)))
    at = 0
    for n in sizes:
        held.keep(data[at:at + n])
        at += n
        assert held.spilled() == on_disk(held), (spill_bytes, sizes, at)
    assert held.spilled() == (spill_bytes > 0 and len(data) > spill_bytes)
    assert b"".join(held.chunks()) == data
    assert held.spill is None and not held.spilled()  # read back once, then closed


def test_nothing_kept_is_nothing_spilled():
    held = Held(spill_bytes=1)
    held.keep(b"")
    assert held.spill is None and not held.spilled() and list(held.chunks()) == []
