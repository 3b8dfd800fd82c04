"""One int object per token id in the process, so a live trace's ids cost 8 bytes each, not 36.

A ``collect_tokens`` session keeps every token id of its graph in memory while it lives (the
nodes' ``token_ids``, and the list the next prompt extends, ``dialects/prompt_ids.py``). Each
id a JSON parser makes is an int object of its own (CPython caches only -5..256): 28 bytes,
plus the list's 8-byte pointer. Those objects, on the nodes and in the kept prompt list (its
restated replies' ids, parsed apart from the completions'), were about half of what a session
kept for its tokens (``bench/hooks.py --collect-tokens --memory``), though a vocabulary has at
most a few hundred thousand distinct ids. So the ids a node is given are replaced, in place, by one shared object per value from a table that grows
to the largest id seen (``CAP`` bounds it: an id past it, or below 0, stays as it is, so an
upstream's odd id cannot make the table large). The values are equal and so is every record
written of them; only where the objects live changes.
"""

from __future__ import annotations

import threading
from typing import Any

#: Ids below this share an object (above the largest vocabularies in use, Gemma's); the
#: table costs 36 bytes an entry up to the largest id seen.
CAP = 1 << 19
_TABLE: list[int] = list(range(257))  # the small ints CPython already shares; _TABLE[i] is i
_GROWING = threading.Lock()


def shared(ids: Any, start: int = 0) -> Any:
    """``ids[start:]`` with each id the process's one object for its value, written back into
    ``ids`` when it is a list (the caller's list then shares them too); ``ids`` as it is
    when it is None, empty there, or holds an id outside ``0..CAP`` or a value that is not an
    index. The ids are a validated ``list[int]`` (pydantic's check, or ``KnownIds``'), so
    each value stays what it was; a bool would become its int."""
    if ids is None:
        return None
    rest = ids[start:] if start else ids
    if not rest:
        return rest
    out = _mapped(rest)
    if out is None:  # an id past the table: grow it to the largest, if that is below CAP
        try:
            high = max(rest)
        except TypeError:  # not comparable: not ids
            return rest
        if not isinstance(high, int) or high >= CAP:
            return rest
        with _GROWING:  # two threads growing at once (read_trace in one) must not append twice
            if high >= len(_TABLE):
                _TABLE.extend(range(len(_TABLE), high + 1))
        out = _mapped(rest)
        if out is None:  # an id far below 0
            return rest
    if out != rest:  # a negative id, read from the table's end
        return rest
    if isinstance(ids, list):
        ids[start:] = out
    return out


def _mapped(rest: Any) -> list[int] | None:
    """Each id's table entry, or None where one is not an index into the table."""
    try:
        return list(map(_TABLE.__getitem__, rest))
    except (IndexError, TypeError):
        return None
