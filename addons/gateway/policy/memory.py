"""The rewrite memory: a request hook's change is made once and remembered.

Harnesses restate their whole history on every request. If a hook replaced a tool result
and the next request restated the original, running the hooks again could give another
answer (a different redaction, a grader that changed its mind), and the graph would fork at
that message while the model read the original. So the first time a hook changes a message,
the replacement is stored under the *original's* identity, and every later request that
restates the original gets the replacement spliced in before anything else looks at it:

- a tool result: its tool call id, the digest of its content and its error flag (tool call
  ids are unique within a conversation);
- any other message: its parent node and its message hash. While the message's own turn is
  not committed yet (a retry of the request that carried it) its parent may not be a node;
  then the key is the deepest stored node above it plus the hashes of the messages between
  (``Chain``). The commit adds the plain (parent node, hash) key.

The graph then holds the delivered content only, and a restatement matches it. Sessions
without request hooks never make one (``Session.memory`` stays empty and is never read).

The tool route (``addons/mitm/toolroute.py``) decides a tool call before the harness sends its
result, so it cannot know the content: its decision is kept under the tool call id alone
(``by_call``) and applies to whatever the harness sends for that call (the block content it
was told to return, the original output, or the output of a blocked tool it ran anyway).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from interceptor.trace.escape import utf8
from interceptor.trace.messages import Message, Part, canonical_json, copied, message_hash
from interceptor.trace.model import Rewrite, Trace

KEEP_BYTES = 64 * 1024  # intercept_rewrite_keep_bytes' default
PASSES = 8  # conversations a session keeps a LastPass for
HANDED = 8  # (hook, conversation) pairs a session keeps a hook's copies for (each a whole history's copies)


def content_text(content: str | list[Part]) -> str:
    """What a digest and a size are of: the text itself, or the parts as canonical JSON."""
    if isinstance(content, str):
        return content
    return canonical_json([p.model_dump(exclude_defaults=True) for p in content])


def digest(content: str | list[Part]) -> tuple[str, int]:
    """sha256 of the content (``content_text``) and its size in UTF-8 bytes."""
    data = utf8(content_text(content))
    return "sha256:" + hashlib.sha256(data).hexdigest(), len(data)


def kept(content: str | list[Part], keep: int) -> tuple[Any, bool]:
    """The original content as the record keeps it: whole when it fits in ``keep`` bytes,
    else its text cut there (on a character boundary); and whether it was cut."""
    text = content_text(content)
    data = utf8(text)
    if len(data) <= keep:
        return (content if isinstance(content, str) else [p.model_dump(exclude_defaults=True) for p in content],
                False)
    return data[:keep].decode("utf-8", "ignore"), True


def conversation(messages: list[Message]) -> str | None:
    """Which conversation of a session a request is in, for what is kept per conversation
    (``Memory.passes``, ``Handed``): its first message's hash. A main agent and the
    sub-agents it starts take turns on one session, each with its own system prompt."""
    return message_hash(messages[0]) if messages else None


def _keep(kept: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """``kept[key] = value`` (the caller took the key out first, so it goes last), then the
    entries heard from least lately dropped down to ``limit``."""
    kept[key] = value
    while len(kept) > limit:
        del kept[next(iter(kept))]


Chain = tuple[int | None, tuple[str, ...]]  # the deepest stored node above, the hashes since


@dataclass(eq=False)
class Remembered:
    """One rewrite: what is delivered instead of the original, and its record (written with
    the first call that goes on the record carrying it; ``recorded`` once it is)."""

    rewrite: Rewrite
    content: str | list[Part]
    is_error: bool  # the delivered flag
    original_hash: str  # message_hash of the original: the plain key once the parent is a node
    recorded: bool = False
    # The last original it was delivered for, the slot, the edits and the message delivered:
    # a restated original is the very object its request's scan remembered
    # (trace/prefix.py), so every later turn's delivery is these again, not made anew.
    last: tuple[Message, Any, list[Any], Message] | None = None


@dataclass
class Memory:
    """One session's remembered rewrites (see the module docstring)."""

    keep_bytes: int = KEEP_BYTES
    tools: dict[tuple[str, str, bool], Remembered] = field(default_factory=dict)
    others: dict[tuple[Chain, str], Remembered] = field(default_factory=dict)
    by_call: dict[str, Remembered] = field(default_factory=dict)  # the tool route's decisions
    # The tool call ids ``tools`` holds a rewrite of: a restated tool result whose id is not
    # here is no original of one, and is not digested to find out (else every result of the
    # history would be digested again every turn).
    _tool_ids: set[str] = field(default_factory=set, repr=False)
    # The message hashes ``others`` holds a rewrite under, whatever the chain.
    _other_hashes: set[str] = field(default_factory=set, repr=False)
    # Every key a rewrite was remembered under, in order: ("call", a tool call id) or
    # ("hash", an original's message hash). ``LastPass`` reads what was added since it was made.
    log: list[tuple[str, str]] = field(default_factory=list, repr=False)
    # The last request's pass of each conversation (``intercept.remembered``), by the hash of
    # its first message: a main agent and its sub-agents take turns on one session.
    passes: dict[str | None, LastPass] = field(default_factory=dict, repr=False)

    def take_pass(self, key: str | None) -> LastPass | None:
        return self.passes.pop(key, None)

    def keep_pass(self, key: str | None, last: LastPass) -> None:
        _keep(self.passes, key, last, PASSES)

    def __bool__(self) -> bool:
        return bool(self.tools or self.others or self.by_call)

    @staticmethod
    def tool_key(message: Message) -> tuple[str, str, bool] | None:
        if message.role != "tool" or not message.tool_call_id:
            return None
        return (message.tool_call_id, digest(message.content)[0], message.is_error)

    def find(self, message: Message, chain: Chain, message_hash: str | None) -> Remembered | None:
        if message.role == "tool" and message.tool_call_id:
            decided = self.by_call.get(message.tool_call_id) if self.by_call else None
            if decided is not None or message.tool_call_id not in self._tool_ids:
                return decided
            return self.tools.get(self.tool_key(message))
        if not self.may_hold(message_hash):
            return None
        return self.others.get((chain, message_hash))

    def may_hold(self, message_hash: str | None) -> bool:
        """Whether a message (not a tool result) of this hash may be a rewrite's original:
        only then is its chain worth working out."""
        return message_hash is not None and message_hash in self._other_hashes

    def remember(self, original: Message, chain: Chain, original_hash: str, entry: Remembered) -> None:
        key = self.tool_key(original)
        if key is not None:
            self.tools[key] = entry
            self._tool_ids.add(key[0])
            self.log.append(("call", key[0]))
        else:
            self.others[(chain, original_hash)] = entry
            self._other_hashes.add(original_hash)
            self.log.append(("hash", original_hash))

    def decide(self, tool_call_id: str, entry: Remembered) -> None:
        """The tool route's decision for a call, whatever result the harness sends for it."""
        self.by_call[tool_call_id] = entry
        self.log.append(("call", tool_call_id))

    def settle(self, entries: list[Remembered], trace: Trace) -> None:
        """After a commit: a message keyed by a chain is now a node, so its plain key is
        (its parent node, its hash) from here on (the chain key stays for a late retry)."""
        for entry in entries:
            node = entry.rewrite.node
            if node is None or entry.rewrite.target == "tool" and entry.rewrite.tool_call_id:
                continue
            if node < len(trace.nodes):
                self.others.setdefault(((trace.nodes[node].parent, ()), entry.original_hash), entry)
                self.log.append(("hash", entry.original_hash))


@dataclass(slots=True, eq=False)
class LastPass:
    """What ``intercept.remembered`` made of a conversation's last request, kept for the next.

    A harness restates its history: the next request's leading messages are this one's
    (mostly the very objects its scan made, trace/prefix.py), and they were nodes, under the
    same parents, then. The rewrites delivered among them are delivered again, and nothing
    else of them is looked at: looking up every message of the history would make each turn
    cost what the whole conversation costs.
    One is kept per conversation of the session (``Memory.passes``, by its first message):
    a main agent and the sub-agents it starts take turns. What can make a shared message's
    answer differ is checked instead: a rewrite remembered since (``Memory.log``, against
    the first message of its key here), a graph rolled back or released (the prefixes'
    ``generation``), another slot for a rewrite at an equal message that is another object.

    Only the leading messages that were nodes are kept: the rest may have become nodes, or
    originals of a rewrite, since. ``sent[i]`` is message i as the request sent it and
    ``parents[i]`` its node."""

    generation: int  # the recorder's ``prefixes.generation`` when made
    seen: int = 0  # how much of ``Memory.log`` was taken into account
    sent: list[Message] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # The rewrites delivered among them, in order: the position, the rewrite, the slot, the
    # edits that wrote it and the message delivered (``Remembered.last``'s).
    hits: list[tuple[int, Remembered, Any, list[Any], Message]] = field(default_factory=list)
    hashes: dict[str, int] = field(default_factory=dict)  # message hash (as sent) -> first position
    calls: dict[str, int] = field(default_factory=dict)  # tool call id -> first position

    def add(self, sent: Message, node: int, sent_hash: str) -> None:
        i = len(self.sent)
        self.sent.append(sent)
        self.parents.append(node)
        self.hashes.setdefault(sent_hash, i)
        if sent.role == "tool" and sent.tool_call_id:
            self.calls.setdefault(sent.tool_call_id, i)

    def cut(self, p: int) -> None:
        """Keep the first ``p`` positions."""
        for i, message in enumerate(self.sent[p:], p):
            h = message_hash(message)  # cached on the message: ``add`` was given it
            if self.hashes.get(h) == i:
                del self.hashes[h]
            if message.role == "tool" and self.calls.get(message.tool_call_id) == i:
                del self.calls[message.tool_call_id]
        del self.sent[p:], self.parents[p:]
        while self.hits and self.hits[-1][0] >= p:
            self.hits.pop()


@dataclass(slots=True)
class Copies:
    """The stored messages one hook was last handed copies of, and those copies, in the order
    handed: the next request's stored messages are usually these very objects, in this order,
    and then more (``intercept._given``)."""

    stored: list[Message] = field(default_factory=list)
    copies: list[Message] = field(default_factory=list)
    # The request's tools the hook was last handed a read-only copy of, and that copy: the
    # same tools (equal; each request parses its own) get the same copy. Claude Code's
    # twenty-odd schemas would otherwise be copied for every hook call and compared after.
    tools: list[Any] | None = None
    tools_copy: list[Any] | None = None


@dataclass
class Handed:
    """The copies of a session's stored messages each request hook was last handed (and
    the request stops, ``intercept.for_stops``, and the hooks' context, ``branch``).

    A hook is handed a copy of the request (it may change it in place, and the proxy's
    messages are the graph's), and copying the whole history every turn would make each turn
    cost what the conversation costs. A message the graph holds may not change at all, so a request
    hook's copies of them are ``read_only`` (a change raises where it is made, the hook's
    error) and the same copies are handed to that hook next turn, for the same message
    objects (a request's known messages are the very objects its scan remembered,
    trace/prefix.py): only the new messages are copied, and only they and a stored one the
    hook replaced in the list are compared after the call. Request stops are handed plain
    copies, each compared with its message after the stops (``kept_for_stops``). A hook
    that fails has its copies dropped."""

    # By hook and conversation (its first message's hash, as ``Memory.passes``): a main agent
    # and its sub-agents take turns, and one set of copies a hook would be copied anew at
    # every switch. Up to ``HANDED``, the least lately handed dropped first.
    by_hook: dict[tuple[str, str | None], Copies] = field(default_factory=dict)

    @staticmethod
    def _key(name: str, messages: list[Message]) -> tuple[str, str | None]:
        return name, conversation(messages)

    def take(self, name: str, messages: list[Message]) -> Copies | None:
        """The copies hook ``name`` was last handed in this conversation, no longer kept."""
        return self.by_hook.pop(self._key(name, messages), None)

    def keep(self, name: str, messages: list[Message], copies: Copies) -> None:
        _keep(self.by_hook, self._key(name, messages), copies, HANDED)

    def kept(self, name: str, messages: list[Message]) -> Copies | None:
        return self.by_hook.get(self._key(name, messages))
    # The copies the hooks' context was last handed of the branch (``HookContext.messages``).
    _branch: dict[int, tuple[Message, Message]] = field(default_factory=dict, repr=False)

    def branch(self, messages: list[Message]) -> list[Message]:
        """Copies of the graph's ``messages`` for a hook's context: a hook that changed one
        in place changed the trace. The copy handed last time is handed again while it is
        still its message's equal (one comparison, of objects that share their strings), so
        a turn copies only the messages new to the branch."""
        kept, fresh = self._branch, {}
        out: list[Message] = []
        for message in messages:
            held = kept.get(id(message))
            copy = held[1] if held is not None and held[0] is message and held[1] == message else copied(message)
            fresh[id(message)] = (message, copy)
            out.append(copy)
        self._branch = fresh
        return out
