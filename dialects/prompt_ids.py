"""vLLM's ``prompt_token_ids``, read from the answer's bytes, parsing only the ids that are new.

vLLM (``return_token_ids``, what a ``collect_tokens`` session asks for) sends the token ids
of the whole prompt with every answer: on the JSON body, or on a stream's first chunk, as
``"prompt_token_ids":[...]`` (vllm/entrypoints/openai/protocol.py, ``ChatCompletionResponse``
and ``ChatCompletionStreamResponse``). Late in a rollout that array is larger than the
request itself, and parsing it whole (and pydantic's check of each id) would cost the event
loop more every turn as the conversation grows (``bench/rollout.py --collect-tokens``).

A chat template renders a conversation so that each turn's prompt begins with the previous
turn's (the prefix property a trainer relies on), so the array almost always begins with
the bytes of the array the session's last answer carried. Those bytes are recognised by
their length and digest (XXH3-128) and stand for the ids the record already holds
for them (``Prior``: the graph path the last prompt's ids were stored along), the very int
objects; the list says so (``trace.graph.KnownIds``), so the graph does not compare them
again and the Response takes them unchecked. Only the bytes after them are parsed. Anything else (another branch, another template, a number spelled
differently, a nested key of the same name) is read whole, as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from interceptor.trace.graph import KnownIds
from interceptor.trace.model import MessageNode

KEY = b'"prompt_token_ids":'
KEY_TEXT = KEY.decode()
# What the array's bytes are replaced with while the rest of the object is parsed: a value
# no upstream sends there, so finding it at the top level proves the key found in the bytes
# was the top-level one.
_HOLE = b'"\\u0000prompt_token_ids"'
_HOLE_VALUE = "\x00prompt_token_ids"
_SPACE = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class PromptRead:
    """How an answer's array read: what the next answer's array is recognised by."""

    length: int  # bytes from its ``[`` through its last id (no closing bracket)
    digest: bytes  # XXH3-128 of those bytes
    count: int  # ids in it


class Record(Protocol):
    """Where a prior's ids are held (``trace.Recorder``)."""

    def prompt_ids(self, leaf: int, node: MessageNode, into: list[int]) -> bool: ...

    def holds(self, leaf: int, node: MessageNode) -> bool: ...


@dataclass(slots=True)
class Prior:
    """The array the session's last committed answer carried, and where the record holds its
    ids: along the graph path to ``leaf``, which was ``node``, in ``record`` (the session's
    ``Recorder``: its ``prompt_ids`` appends them to a list, or says False when the record no
    longer has them, a rollback or a released trace; its ``holds`` says whether it still has).

    ``ids``: the very list that answer's Response carried, handed on once (``known``) to the
    next prompt that begins with it, which extends it in place. Joining the whole prompt's ids
    from the path's nodes again would touch every int object (a reference count each, the
    objects spread through the heap); extending the kept list touches only the new ones. It costs 8 bytes an id while the
    session lives (the ints themselves are the nodes'), one list a session: a committed
    Response is not read again, and the list is taken from it, not copied."""

    read: PromptRead
    leaf: int
    node: MessageNode
    record: Record
    ids: KnownIds | None = None

    def known(self) -> KnownIds | None:
        """The ids the record holds along the path to ``leaf``, as a ``KnownIds`` naming this
        prior: the kept list if there is one (taken: a second prompt off the same prior joins
        its own), else joined from the path's nodes; None if the record no longer holds them."""
        count = self.read.count
        out, self.ids = self.ids, None
        if out is not None and len(out) == count and self.record.holds(self.leaf, self.node):
            out.leaf, out.node, out.count = self.leaf, self.node, count
            return out
        out = KnownIds(self.leaf, self.node)
        if self.record.prompt_ids(self.leaf, self.node, out) and len(out) == count:
            out.count = count
            return out
        return None


def span(payload: bytes, key: bytes = KEY, pos: int = 0) -> tuple[int, int, int] | None:
    """(key, ``[``, ``]``) offsets of the first ``key`` (``"prompt_token_ids":``) from
    ``pos`` on in ``payload`` and the array after it, or None (no such key, or no array
    there). The key can be matched in the raw text because a quote inside a JSON string is
    always escaped; whether it is the top-level key is for the caller to prove (``load``),
    and that the array is flat (``]`` is the first one after its ``[``)."""
    k = payload.find(key, pos)
    if k < 0:
        return None
    start = payload.find(b"[", k + len(key))
    end = payload.find(b"]", start)
    if start < 0 or end < 0 or payload[k + len(key):start].strip():
        return None
    return k, start, end


class Pending:
    """Ids read past the prior's, not yet joined to the record's (``load(later=True)``): a
    stream's first chunk carries them, and the whole list made then would live through the
    rest of the stream as a young container of a whole prompt's ids that every young
    collection of the garbage collector walks. Joined when the stream is assembled; the array's bytes (a view of
    the event's, not walked by the collector, not copied) are kept for a record that no
    longer holds the prior's ids by then."""

    __slots__ = ("prior", "tail", "array")

    def __init__(self, prior: Prior, tail: list[int], array: memoryview) -> None:
        self.prior, self.tail, self.array = prior, tail, array

    def ids(self) -> list[int]:
        out = self.prior.known()
        if out is not None:
            out += self.tail
            return out
        return json.loads(bytes(self.array))  # the record no longer holds them: the whole read


def joined(ids: list[int] | Pending | None) -> list[int] | None:
    """What ``load(later=True)`` left, as the ids."""
    return ids.ids() if type(ids) is Pending else ids


def load(payload: bytes, priors: Sequence[Prior] = (), *, later: bool = False) -> tuple[Any, PromptRead | None]:
    """``json.loads(payload)``, with a top-level ``prompt_token_ids`` array read by ``ids``
    (``later``: a ``Pending`` where a prior's bytes began it). Raises ``ValueError`` as
    ``json.loads`` does for what is not JSON."""
    where = span(payload)
    if where is None:
        return json.loads(payload), None
    _, start, end = where
    obj = json.loads(payload[:start] + _HOLE + payload[end + 1:])
    if not isinstance(obj, dict) or obj.get("prompt_token_ids") != _HOLE_VALUE:
        return json.loads(payload), None  # the key found was not the top-level one
    read = ids(memoryview(payload)[start:end + 1], priors, later)
    if read is None:
        return json.loads(payload), None
    obj["prompt_token_ids"], info = read
    return obj, info


def ids(array: memoryview, priors: Sequence[Prior] = (), later: bool = False) -> tuple[list[int] | Pending, PromptRead] | None:
    """The ids of ``array`` (``[`` through ``]``) and how it read; None if it is not a JSON
    array. The ids are ``KnownIds`` (the record's own, then the new ones, each checked to
    be an ``int``; ``later``: a ``Pending`` that makes them) when one of the ``priors`` (the
    session's last few, most recent first: sub-agents take turns) began it; else whatever
    ``json.loads`` made of it, which ``parse_response`` checks as ever."""
    last = len(array) - 1  # the closing bracket
    while last > 1 and array[last - 1] in _SPACE:
        last -= 1
    for prior in priors:
        known = prior.read
        if not known.count or known.length >= last:
            continue
        comma = known.length
        while comma < last and array[comma] in _SPACE:
            comma += 1
        if array[comma] != 0x2C:  # ','
            continue
        hasher = xxhash.xxh3_128(array[:known.length])
        if hasher.digest() != known.digest:
            continue
        tail = _tail(array[comma + 1:])
        if tail is None:
            break  # not ids after all: the whole read says what they are
        hasher.update(array[known.length:last])
        read = PromptRead(last, hasher.digest(), known.count + len(tail))
        if later:
            return Pending(prior, tail, array), read
        out = prior.known()
        if out is not None:
            out += tail
            return out, read
        break  # the record no longer holds them
    try:
        whole = json.loads(bytes(array))
    except ValueError:
        return None
    if not isinstance(whole, list):
        return None
    return whole, PromptRead(last, xxhash.xxh3_128(array[:last]).digest(), len(whole))


def _tail(rest: memoryview) -> list[int] | None:
    """The ids after the known ones (``rest`` runs through the closing bracket), if each is
    an ``int`` (JSON ``true`` parses to a bool, ``1.0`` to a float: left to the whole read)."""
    try:
        tail = json.loads(b"[" + bytes(rest))
    except ValueError:
        return None
    if not isinstance(tail, list) or not tail or not all(type(x) is int for x in tail):
        return None  # empty: a trailing comma, which is no JSON
    return tail
