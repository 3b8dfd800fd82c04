"""Request hooks: the evaluator's rewrites of what the model is about to read.

A hook marked ``@intercept`` with a ``Request`` parameter sees the canonical request after the
session's overrides and returns it changed (or None: the request it was given, which it may
have changed in place). It may change the content and ``is_error`` of the request's **new**
user and tool messages only, those beyond the prefix the graph already holds; anything else
(adding, removing or reordering messages, a role, a tool call id, the tools, the model, a
message already in the conversation) is a hook error, and so is content the wire format
cannot carry (``Dialect.content_edits``).

Each change is applied once and remembered (``addons/gateway/policy/memory.py``): a later request that
restates the original gets the replacement spliced in by ``remembered`` before any policy
runs, without calling a hook. So does a tool result the tool route decided
(``addons/mitm/toolroute.py``), whatever content the harness sends for it; the hooks do not
decide that message again (a change they make to it is left out). Either way only the changed content is written anew; every
other byte of the harness's body stays as it was (``dialects.body.Edit``), and the canonical
request takes the delivered content, so the graph holds what the model read and never forks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from interceptor.addons.gateway.exchange import Walked
from interceptor.addons.gateway.policy.hookrun import HookFailure, call, effective_request
from interceptor.addons.gateway.policy.memory import Chain, Copies, Handed, LastPass, Remembered, conversation, digest, kept
from interceptor.dialects.base import RewriteError, Slot
from interceptor.dialects.body import Edit
from interceptor.trace.hooks import HookContext, HookSpec
from interceptor.trace.ids import new_id
from interceptor.trace.messages import Message, Request, copied, message_hash, read_only
from interceptor.trace.model import Rewrite
from interceptor.trace.prefix import alike, identical

if TYPE_CHECKING:
    from interceptor.addons.gateway.exchange import Exchange

_SAME = ("tools", "model", "sampling", "stream", "extra")
TOOL_ROUTE = "tool_route"  # Rewrite.by of the tool route's decisions


def has_request_hooks(ex: Exchange) -> bool:
    hooks = ex.session.hooks
    return hooks is not None and bool(hooks.request)


class _Slots(Sequence):
    """``content_slots`` read element by element as asked: the message list's scan says
    which element made each message (``Listed.marks``), so a turn that splices a few
    messages does not make a slot for every message of the history."""

    def __init__(self, dialect: Any, body: dict[str, Any], lead: int, marks: list[int]) -> None:
        self.dialect, self.body, self.lead, self.marks = dialect, body, lead, marks
        self._made: dict[int, list[Slot | None] | None] = {}

    def __len__(self) -> int:
        return self.lead + self.marks[-1]

    def __getitem__(self, i: int) -> Slot | None:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        m = i - self.lead
        if m < 0:
            return None  # a system prompt's: never rewritten
        j = bisect.bisect_right(self.marks, m)
        before = self.marks[j - 1] if j else 0
        if j not in self._made:
            slots = self.dialect.element_slots(self.body, j)
            self._made[j] = slots if slots is not None and len(slots) == self.marks[j] - before else None
        slots = self._made[j]
        return slots[m - before] if slots is not None else None  # None: cannot be written (refused)


def slots_of(ex: Exchange) -> Sequence[Slot | None] | None:
    """Where each message of ``ex.request`` lives in the body (None for the messages a
    Responses chain took from the record), or None when the dialect cannot splice."""
    if ex.body is None or ex.request is None or ex.translation is not None:
        return None  # a translated body is not the harness's: nothing of it to splice into
    listed = ex.listed
    if (listed is not None and ex.prefix_len == 0 and listed.complete and listed.key in ex.body
            and len(ex.request.messages) == listed.lead + listed.marks[-1]
            and ex.dialect.element_slots(ex.body, 0) is not None):
        return _Slots(ex.dialect, ex.body, listed.lead, listed.marks)
    slots = ex.dialect.content_slots(ex.body, chained=ex.prefix_len > 0)
    if slots is None:
        return None
    slots = [None] * ex.prefix_len + slots
    return slots if len(slots) == len(ex.request.messages) else None


def _walk(ex: Exchange, messages: list[Message]) -> tuple[int, int | None]:
    """The number of leading messages the graph holds, and the node of the last of them:
    what ``remembered`` found for these very messages while the graph has not changed since
    (so no second pass over every node of the history);
    else those the request's scan knows are checked against their nodes
    (``Recorder.held_path``), only the rest looked up one by one."""
    recorder = ex.session.recorder
    walked = ex.walked
    if walked is not None and walked.messages is messages and walked.current(recorder):
        return walked.on, walked.last
    path = recorder.held_path(ex.listed, messages)
    parent = path[-1] if path else None
    for k in range(len(path), len(messages)):
        node = recorder.child(parent, messages[k])
        if node is None:
            return k, parent
        parent = node
    return len(messages), parent


class Undeliverable(Exception):
    """A remembered rewrite applies to a request it cannot be written into (a translated
    body, a dialect with no slot for the message): forwarding the original would let the
    model read what the policy replaced, so the request is refused (``Stops``)."""


def remembered(ex: Exchange) -> None:
    """Splice every remembered replacement into a request that restates its original
    (the module docstring). Runs no hook; cheap when the session remembers nothing, and
    a few dictionary lookups per message when it does: a tool result is looked up by its
    call id first, another message by its hash first, and only a message that may be an
    original has its chain made; the nodes come from the request's scan where it knows them
    (each checked to be its message's child of the one before), else from the graph. The
    leading messages a request shares with its conversation's last one (the same objects,
    or equal ones) get what they got then (``LastPass``); only the rest are looked at."""
    memory = ex.session.memory
    if not memory or ex.request is None:
        return
    messages = list(ex.request.messages)
    recorder = ex.session.recorder
    others = bool(memory.others)
    first = ex.prefix_len  # the messages before it a chain took from the record: not the body's
    # Kept for the next request: the whole history as the harness sent it (no chain, nothing
    # carried in from a warm-up), with the parents followed (``others``).
    keep = others and first == 0 and not ex.carried and bool(messages)
    key = conversation(messages) if keep else None
    last, p = _going_on(ex, messages, memory.take_pass(key)) if keep else (None, 0)
    keeping = last  # kept once this request's pass is through (not after an Undeliverable)
    nodes = recorder.scan_path(ex.listed, messages) if others else []
    stored = recorder.trace.nodes
    slots: Sequence[Slot | None] | None = None
    parent: int | None = last.parents[p - 1] if p else None
    tail: list[str] = []
    on_graph = True  # every message so far is a node
    on, above = p, parent  # how many leading messages are nodes, and the last of them (once one is not)
    changed = p > 0 and bool(last.hits)
    for i in range(p, len(messages)):
        message = sent = messages[i]
        h = sent_hash = (message.__pydantic_private__["_hash"] or message_hash(message)) if others else None
        hit = None
        if i >= first and ((message.role == "tool" and message.tool_call_id) or memory.may_hold(h)):
            hit = memory.find(message, (parent, tuple(tail)), h)
        delivered = hit is not None and hit not in ex.carried
        if delivered:
            slots = slots_of(ex) if slots is None else slots
            if slots is None or slots[i] is None:
                where = ("a translated body" if ex.translation is not None
                         else f"a {ex.dialect.name} body")
                raise Undeliverable(f"message {i} ({message.role}) was decided before ({hit.rewrite.by or 'hook'}"
                                    f"{' ' + hit.rewrite.tool_call_id if hit.rewrite.tool_call_id else ''}) "
                                    f"and cannot be written into {where}; nothing was forwarded")
            if hit.rewrite.position is None and not hit.recorded:
                hit.rewrite.position = i  # a tool route's decision: where it is first delivered
            message = messages[i] = _deliver(ex, slots[i], message, hit)
            ex.carried.append(hit)
            changed = True
            h = message_hash(message) if others else None  # the delivered one's
        if not others:
            continue
        node = None
        if on_graph:
            known = nodes[i] if i < len(nodes) else None
            held = stored[known] if known is not None else None
            if held is not None and held.parent == parent and (held.message is message or held.message == message):
                node = known
                if held.message is not message and hit is not None and hit.last is not None and hit.last[3] is message:
                    # A delivered message equal to its node's: deliver the node's own from now
                    # on, so each later check of it is an identity test (trace/recorder.py).
                    messages[i] = held.message
                    hit.last = (*hit.last[:3], held.message)
            else:
                node = recorder.child(parent, message)
        if node is not None:
            parent = node
            on = i + 1
            if last is not None:
                last.add(sent, node, sent_hash)
                if delivered:
                    last.hits.append((i, hit, hit.last[1], hit.last[2], messages[i]))
        else:
            if on_graph:
                on_graph, above = False, parent
            tail.append(h)
            last = None  # it keeps the leading nodes only
    if keeping is not None:
        memory.keep_pass(key, keeping)
    if changed:
        ex.request = ex.request.model_copy(update={"messages": messages})
    if others:
        ex.walked = Walked(ex.request.messages, on, parent if on_graph else above, len(stored),
                           recorder.prefixes.generation)


def _going_on(ex: Exchange, messages: list[Message], last: LastPass | None) -> tuple[LastPass, int]:
    """The conversation's ``LastPass`` cut to the leading messages this request shares with
    it (the same objects or equal ones, none of them the first message of a key remembered
    since, each rewrite among them at the same slot), those rewrites delivered again into
    ``messages`` and ``ex``; and how many messages it covers: where the caller's pass
    begins. A new one and 0 when there is none to go on from."""
    memory, recorder = ex.session.memory, ex.session.recorder
    generation = recorder.prefixes.generation  # bumped by a rollback or a release
    if last is None or last.generation != generation:
        return LastPass(generation, len(memory.log)), 0
    p = alike(last.sent, messages)
    for kind, key in memory.log[last.seen:]:  # a rewrite remembered since: from its key's first message on
        at = (last.calls if kind == "call" else last.hashes).get(key)
        if at is not None and at < p:
            p = at
    last.seen = len(memory.log)
    slots: Sequence[Slot | None] | None = None
    for i, _, slot, _, _ in last.hits:
        if i >= p:
            break
        if last.sent[i] is messages[i]:
            continue  # the same element of a remembered list (trace/prefix.py): the same slot
        slots = slots_of(ex) if slots is None else slots
        if slots is None or slots[i] != slot:  # the pass finds out what to do with it
            p = i
            break
    last.cut(p)
    last.sent[:p] = messages[:p]  # the objects the next request's scan hands back
    for i, hit, _, edits, delivered in last.hits:
        messages[i] = delivered
        ex.edits += edits
        ex.carried.append(hit)
    return last, p


def _deliver(ex: Exchange, slot: Slot, message: Message, hit: Remembered) -> Message:
    """``message`` with the remembered content in, and the edits that put it in the body
    (none when the harness sent it already, as it does when it honours the tool route's block).
    The same original at the same slot as last time (the very object a restated history's
    scan hands back) gets the same edits and the same delivered message."""
    if hit.last is not None and hit.last[0] is message and hit.last[1] == slot:
        ex.edits += hit.last[2]
        return hit.last[3]
    flag = hit.is_error if hit.is_error != message.is_error else None
    edits: list[Edit] = []
    delivered = message
    if message.content != hit.content or flag is not None:
        try:
            edits = ex.dialect.content_edits(slot, ex.body, hit.content, flag)
        except RewriteError:
            if flag is None or hit.rewrite.by != TOOL_ROUTE:
                raise
            # The route decided before it knew the wire format: one with no error flag for
            # this message (Chat, Responses) carries the content alone.
            flag = None
            if message.content != hit.content:
                edits = ex.dialect.content_edits(slot, ex.body, hit.content, None)
        delivered = message.model_copy(update={"content": hit.content,
                                               "is_error": hit.is_error if flag is not None else message.is_error})
    hit.last = (message, slot, edits, delivered)
    ex.edits += edits
    return delivered


def _decided(ex: Exchange, message: Message) -> bool:
    """A tool result the tool route decided: the hooks do not decide it again."""
    by_call = ex.session.memory.by_call
    return bool(by_call) and message.role == "tool" and message.tool_call_id in by_call


def _check(spec: HookSpec, before: Request, after: Request, known: int,
           handed: list[Message] | None = None, tools: list[Any] | None = None) -> list[int]:
    """The messages ``spec`` changed; HookFailure for any change a hook may not make.
    ``handed``: the read-only copies the hook was handed of the first ``known`` messages;
    those still in their places are unchanged, and are not compared; so are ``tools``, the
    read-only copy of the tools it was handed, while the request still holds it."""
    if len(after.messages) != len(before.messages):
        raise HookFailure(spec, f"a request hook may not add or remove messages "
                                f"({len(before.messages)} before, {len(after.messages)} after)")
    for name in _SAME:
        if name == "tools" and tools is not None and after.tools is tools:
            continue
        if getattr(after, name) != getattr(before, name):
            raise HookFailure(spec, f"a request hook may not change the request's {name}")
    changed: list[int] = []
    start = min(identical(after.messages, handed), known) if handed is not None else 0
    for i, (b, a) in enumerate(zip(before.messages[start:], after.messages[start:]), start):
        if (a.__class__ is b.__class__ and a.__dict__ == b.__dict__) or a == b:
            continue  # Message.__eq__ compares the dicts: the same without a call per message
        where = f"message {i} ({b.role})"
        if not isinstance(a, Message) or a.role != b.role:
            raise HookFailure(spec, f"{where}: a request hook may not replace a message or change its role")
        if i < known:
            raise HookFailure(spec, f"{where} is in the conversation already; only the new user and tool "
                                    f"messages (from message {known} on) may change")
        if b.role not in ("user", "tool"):
            raise HookFailure(spec, f"{where}: only user and tool messages may change")
        rest_b = b.model_dump(exclude={"content", "is_error"})
        rest_a = a.model_dump(exclude={"content", "is_error"})
        if rest_a != rest_b:
            keys = sorted(k for k in rest_b if rest_a.get(k) != rest_b[k])
            raise HookFailure(spec, f"{where}: only content and is_error may change, not {', '.join(keys)}")
        try:
            Message.model_validate(a.model_dump())
        except ValidationError as e:
            raise HookFailure(spec, f"{where}: not a valid message: {e.errors()[0]['msg']}") from None
        changed.append(i)
    return changed


async def run_hooks(specs: tuple[HookSpec, ...], ctx: HookContext, request: Request,
                    known: int, handed: Handed | None = None) -> tuple[Request, dict[int, list[HookSpec]]]:
    """The request after every request hook in turn (each given a copy of the one before's
    result), and which hooks changed each message. HookFailure for a hook that raises or
    breaks the contract (``known``: the messages before it may not change). ``handed``: the
    session's copies of its first ``known`` messages, reused (``Handed``)."""
    current = request
    changed_by: dict[int, list[HookSpec]] = {}
    for spec in specs:
        given, copies = _given(current, request, known, handed.take(spec.name, request.messages) if handed else None)
        result = await call(spec, ctx, given)
        if result is None:
            result = given
        elif not isinstance(result, Request):
            raise HookFailure(spec, f"a request hook returns a Request or None, not {type(result).__name__}")
        for i in _check(spec, current, result, known, copies.copies, copies.tools_copy):
            changed_by.setdefault(i, []).append(spec)
        if handed is not None:  # read-only: their copies are as made
            handed.keep(spec.name, request.messages, copies)
        current = result
    return current, changed_by


def _given(current: Request, request: Request, known: int, before: Copies | None,
           read: bool = True) -> tuple[Request, Copies]:
    """A copy of ``current`` for a hook, and the copies of ``request``'s first ``known``
    messages in it (``Copies``): ``before``'s where they are of the same message object (or,
    in the leading run, an equal one), new ones for the rest. ``current``'s first ``known`` messages are equal to ``request``'s (a
    hook before that changed one failed). Those copies are ``read_only`` (``read``; a
    request hook may not change them, so they need no comparing afterwards); the rest are
    plain. Usually ``before`` was handed for the same objects in the same order and the
    request goes on from them: its lists are kept and only the rest copied, without a lookup
    per message."""
    stored = request.messages
    same = alike(before.stored, stored[:known]) if before is not None else 0
    if before is not None and same >= len(before.stored) - 1:
        # ``before`` was taken out of ``Handed``: its lists are this call's to grow. Its last
        # message may be another now: the first restatement of a reply is parsed anew, and
        # the remembered list holds the node's own from then on (Recorder._as_held). An equal
        # message that is another object (Anthropic's system prompt, parsed every turn) keeps
        # its copy, which equals it.
        held = before
        held.stored[:] = stored[:same]
        del held.copies[same:]
    else:  # another order (a fork, an edited history): by object, where it was handed one
        by_id = {id(m): c for m, c in zip(before.stored, before.copies)} if before is not None else {}
        held = Copies()  # ``before`` holds its messages alive: an id found is the same object
        for i, message in enumerate(stored[:known]):
            copy = by_id.get(id(message))
            if copy is None or read and copy.__pydantic_private__.get("_at") != i:  # it names its index
                copy = read_only(message, i) if read else copied(message)
            held.stored.append(message)
            held.copies.append(copy)
    for i in range(len(held.stored), known):
        held.stored.append(stored[i])
        held.copies.append(read_only(stored[i], i) if read else copied(stored[i]))
    messages = held.copies[:known]
    messages += [copied(m) for m in current.messages[known:]]
    given = copied(current.model_copy(update={"messages": [], "tools": []}))
    given.messages = messages
    tools = current.tools
    if read and before is not None and before.tools_copy is not None and (before.tools is tools or before.tools == tools):
        held.tools, held.tools_copy = tools, before.tools_copy
    else:
        held.tools, held.tools_copy = tools, read_only(tools) if read else None
    given.tools = held.tools_copy if read else copied(tools)
    return given, held


STOPS = "\0request stops"  # Handed's key for the copies request stops are handed


def for_stops(ex: Exchange) -> Request | None:
    """What the request stops are handed: a copy of the request as the upstream will get it.
    A stop may not change it, and its messages are the graph's and the remembered lists'
    (a stop that trimmed one in place for its own reading changed the trace). The copies of
    the messages are kept for the next request (``Handed``) while the stops leave them
    unchanged (``kept_for_stops``)."""
    request = effective_request(ex)
    if request is None:
        return None
    handed = ex.session.handed
    given, copies = _given(request, request, len(request.messages), handed.take(STOPS, request.messages), read=False)
    handed.keep(STOPS, request.messages, copies)
    return given


def kept_for_stops(ex: Exchange) -> None:
    """After the request stops: their copies are kept only if every one is still its
    message's equal (a stop that changed one gets fresh copies next time)."""
    messages = ex.request.messages if ex.request is not None else []
    copies = ex.session.handed.kept(STOPS, messages)
    if copies and any(copy != stored for stored, copy in zip(copies.stored, copies.copies)):
        ex.session.handed.take(STOPS, messages)


async def rewrite(ex: Exchange, ctx: HookContext) -> None:
    """Run the session's request hooks over the request's new messages and splice what
    they changed; each change is remembered and carried (``ex.carried``). HookFailure for a
    hook that raises or breaks the contract."""
    request = ex.request
    if request is None:
        return
    known, last = _walk(ex, request.messages)
    current, changed_by = await run_hooks(ex.session.hooks.request, ctx, effective_request(ex), known,
                                          ex.session.handed)
    todo = [i for i in sorted(changed_by) if (current.messages[i].content, current.messages[i].is_error)
            != (request.messages[i].content, request.messages[i].is_error) and not _decided(ex, request.messages[i])]
    if not todo:
        return
    slots = slots_of(ex)
    messages = list(request.messages)
    edits = []  # all or nothing: a message that cannot be written fails the whole request's rewrite
    for i in todo:
        spec = changed_by[i][-1]
        slot = slots[i] if slots is not None else None
        new, old = current.messages[i], request.messages[i]
        if slot is None:
            raise HookFailure(spec, f"message {i} ({old.role}) cannot be rewritten in a {ex.dialect.name} body")
        try:
            edits += ex.dialect.content_edits(slot, ex.body, new.content,
                                              new.is_error if new.is_error != old.is_error else None)
        except RewriteError as e:
            raise HookFailure(spec, f"message {i} ({old.role}): {e}") from None
        messages[i] = old.model_copy(update={"content": new.content, "is_error": new.is_error})
    ex.edits += edits
    memory = ex.session.memory
    for i in todo:
        old = request.messages[i]
        chain: Chain = (last, tuple(message_hash(m) for m in messages[known:i]))
        record = rewrite_record(old, messages[i], [s.name for s in changed_by[i]], ex.session.memory.keep_bytes,
                                call=ex.call_id or None, position=i)
        entry = Remembered(record, messages[i].content, messages[i].is_error, message_hash(old))
        memory.remember(old, chain, entry.original_hash, entry)
        ex.carried.append(entry)
    ex.request = request.model_copy(update={"messages": messages})


def rewrite_record(old: Message, new: Message, hooks: list[str], keep: int, *, by: str = "hook",
                   call: str | None = None, position: int | None = None, reason: str | None = None) -> Rewrite:
    """The ``rewrite`` record of ``old`` delivered as ``new``, keeping up to ``keep`` bytes
    of the original."""
    before, size_before = digest(old.content)
    after, size_after = digest(new.content)
    original, cut = kept(old.content, keep) if keep > 0 else (None, size_before > 0)
    tool = old.role == "tool"
    # Non-text parts of the original the hook left out (a text part's change is the content's).
    removed = [f"content[{k}]" for k, part in enumerate(old.content if isinstance(old.content, list) else [])
               if part.type != "text" and part not in (new.content if isinstance(new.content, list) else [])]
    return Rewrite(
        direction="request", by=by, id=new_id(), call=call,
        hooks=hooks, target=old.role, position=position, tool_call_id=old.tool_call_id,
        what="tool_result" if tool else "user_message",
        message=f"tool {old.tool_call_id}" if tool and old.tool_call_id else f"message {position}",
        digest_before=before, digest_after=after, size_before=size_before, size_after=size_after,
        is_error=new.is_error if new.is_error != old.is_error else None,
        original=original, original_truncated=cut, removed=removed, reason=reason,
    )


def spliced(ex: Exchange) -> bytes | None:
    """The body with the edits in, or None if there are none and the body is written
    already (``Exchange.unwritten``): the keys the overrides (and Collect) changed written
    from the parsed body, the edited values written anew, every other byte the harness's.
    The edits reach the parsed body only now, last in the body first, so a run of blocks
    replaced by more or fewer never shifts an index still to come (each edit's path is into
    the body as the harness sent it)."""
    if ex.parsed is None or ex.body is None or not (ex.edits or ex.unwritten and ex.overrides):
        return None
    fresh: set[int] = set()  # the containers copied on the way so far
    for edit in sorted(ex.edits, key=lambda e: (*e.path, *(e.run or ())), reverse=True):
        edit.apply(ex.body, fresh)
    changed = {o.key.split(".", 1)[0] for o in ex.overrides}
    return ex.parsed.encode(changed, ex.edits)

