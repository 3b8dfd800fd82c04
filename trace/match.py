"""Find the recorded turn a request asks for again: LLM-aware matching over a trace's graph.

A replay cannot match whole request bodies: they never repeat across runs (Claude Code's
billing header changes with every request, SDKs put session and request ids in them, dates
and temporary paths move). What the model is asked is the canonical conversation, and the
graph already keys it: every node is a message under its parent, so a prompt's walk from the
roots by message hash ends at the node whose sampled child is the answer. The dialects have
taken out what is transport, not content (the billing block, ``cache_control``; ids and
``metadata`` never reach a canonical message), so the walk needs nothing more for them.

What else changes between runs without changing the task (a tool output's "Wall time 0.01
seconds", a date, a temp path) is the caller's to name, as ``Ignore`` rules: JSON paths into
the canonical request (``$.messages[*].content``, ``$.messages[2].name``, ``$.tools``) whose
values are left out on both sides, and regular expressions whose matches are blanked in every
string. The rules apply to the recorded messages and the new ones alike, so both are compared
in the same normal form; with no rules the form is ``message_hash`` itself.

A miss says where the two conversations part (``Miss``): the nearest recorded turn, the first
differing message (index, role) and a short diff of it as the rules left it, because "no match" alone leaves the
person who changed a prompt guessing which change mattered.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from interceptor.trace.messages import (
    Choice, Message, Response, Tool, canonical_json, message_hash,
)
from interceptor.trace.model import ModelCall, Trace

_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\*|\d+)\]")


def parse_path(text: str) -> tuple[str | int, ...]:
    """``$.messages[*].content`` as ``("messages", "*", "content")``; ValueError if it is not
    a path of keys and ``[n]``/``[*]`` indices under ``$.messages`` or ``$.tools``."""
    if not text.startswith("$"):
        raise ValueError(f"a JSON path starts with '$': {text!r}")
    out: list[str | int] = []
    at = 1
    while at < len(text):
        m = _SEGMENT.match(text, at)
        if m is None:
            raise ValueError(f"not a JSON path such as $.messages[*].content: {text!r}")
        key, index = m.groups()
        out.append(key if key is not None else ("*" if index == "*" else int(index)))
        at = m.end()
    if not out or out[0] not in ("messages", "tools"):
        raise ValueError(f"a path names $.messages or $.tools of the canonical request: {text!r}")
    return tuple(out)


def _drop(value: Any, path: tuple[str | int, ...]) -> Any:
    """``value`` without what ``path`` names (a copy where it changes)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(value, dict) and isinstance(head, str) and head != "*":
        if head not in value:
            return value
        if not rest:
            return {k: v for k, v in value.items() if k != head}
        return {**value, head: _drop(value[head], rest)}
    if isinstance(value, list) and (head == "*" or isinstance(head, int)):
        if not rest:
            return [v for i, v in enumerate(value) if not (head == "*" or i == head)]
        return [_drop(v, rest) if head == "*" or i == head else v for i, v in enumerate(value)]
    return value


def _blank(value: Any, patterns: tuple[re.Pattern[str], ...]) -> Any:
    if isinstance(value, str):
        for p in patterns:
            value = p.sub("", value)
        return value
    if isinstance(value, dict):
        return {k: _blank(v, patterns) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v, patterns) for v in value]
    return value


@dataclass(frozen=True)
class Ignore:
    """What a comparison leaves out: JSON paths (``$...``) and regular expressions (the rest)."""

    message_paths: tuple[tuple[str | int, ...], ...] = ()  # below $.messages: (index or "*", ...)
    tool_paths: tuple[tuple[str | int, ...], ...] = ()  # below $.tools
    patterns: tuple[re.Pattern[str], ...] = ()

    @classmethod
    def parse(cls, rules: list[str] | tuple[str, ...] = ()) -> Ignore:
        """ValueError naming a rule that is neither a path nor a valid regular expression."""
        messages, tools, patterns = [], [], []
        for rule in rules:
            if rule.startswith("$"):
                path = parse_path(rule)
                (messages if path[0] == "messages" else tools).append(path[1:])
            else:
                try:
                    patterns.append(re.compile(rule))
                except re.error as e:
                    raise ValueError(f"not a regular expression: {rule!r}: {e}") from e
        return cls(tuple(messages), tuple(tools), tuple(patterns))

    def __bool__(self) -> bool:
        return bool(self.message_paths or self.tool_paths or self.patterns)

    def normal(self, message: Message, index: int) -> Message | Any:
        """``message`` at position ``index`` of a prompt as the rules leave it: a Message, or
        the bare data when a path took out what a Message needs; None when a path ignores it
        whole. What is compared, and so what a miss reports."""
        if not self:
            return message
        data: Any = message.model_dump(mode="json", exclude_defaults=True)
        for path in self.message_paths:
            head = path[0] if path else "*"
            if head == "*" or head == index:
                if len(path) <= 1:
                    return None  # the whole message: any message matches here
                data = _drop(data, path[1:])
        data = _blank(data, self.patterns)
        try:
            return Message.model_validate({"role": message.role, **data})
        except ValueError:
            return data

    def message(self, message: Message, index: int) -> str:
        """The hash of ``message`` at position ``index`` of a prompt, in the normal form."""
        normal = self.normal(message, index)
        if normal is None:
            return "ignored"
        if isinstance(normal, Message):
            return message_hash(normal)
        return hashlib.sha256(canonical_json(normal).encode("utf-8", "surrogatepass")).hexdigest()

    def tools(self, tools: list[Tool]) -> str:
        data: Any = [t.model_dump(mode="json", exclude_defaults=True) for t in tools]
        for path in self.tool_paths:
            data = _drop({"t": data}, ("t", *path)).get("t", [])
        return canonical_json(_blank(data, self.patterns))


@dataclass
class Hit:
    call: ModelCall
    response: Response


@dataclass
class Miss:
    """Where a prompt parts from every recorded one."""

    index: int  # the first differing message of the prompt
    role: str | None  # its role in the prompt (None: the prompt ended there)
    nearest: ModelCall | None  # the recorded turn sharing the longest prefix
    recorded: Message | None  # that turn's message at ``index`` (None: its prompt ended)
    sent: Message | None
    reason: str = ""
    ignore: Ignore = field(default_factory=Ignore)  # the rules both sides were compared under

    def message(self) -> str:
        where = f"nearest recorded turn: call {self.nearest.id}" if self.nearest else "the trace has no turn"
        if self.reason:
            return f"no recorded turn matches this request: {self.reason} ({where})"
        if self.sent is None:
            what = f"the prompt ends after message {self.index - 1}, where the trace has no answer"
        elif self.recorded is None:
            what = f"message {self.index} ({self.role}) is past the end of the recorded prompt"
        else:
            what = (f"message {self.index} ({self.role}) differs: "
                    f"{message_diff(self.recorded, self.sent, self.ignore, self.index)}")
        return f"no recorded turn matches this request: {what} ({where})"


def message_diff(recorded: Message, sent: Message, ignore: Ignore = Ignore(), index: int = 0) -> str:
    """How two messages differ, shortly, in the form ``ignore`` compared them (what a rule
    took out is no difference, and showing it would hide whether the rule worked): their
    texts where those differ (what a person edited), else their canonical JSON (a tool call,
    an id, reasoning)."""
    a, b = ignore.normal(recorded, index), ignore.normal(sent, index)
    if isinstance(a, Message) and isinstance(b, Message) and a.text() != b.text():
        return short_diff(a.text(), b.text())
    a, b = (canonical_json(m.model_dump(mode="json", exclude_defaults=True) if isinstance(m, Message) else m)
            for m in (a, b))
    return short_diff(a, b)


def short_diff(recorded: str, sent: str, context: int = 30) -> str:
    """``recorded '…abc…' vs sent '…abd…'`` around the first character where they differ."""
    at = next((i for i, (a, b) in enumerate(zip(recorded, sent)) if a != b), min(len(recorded), len(sent)))
    start = max(0, at - context)

    def cut(s: str) -> str:
        piece = s[start:at + context]
        return ("…" if start else "") + piece + ("…" if at + context < len(s) else "")

    return f"recorded {cut(recorded)!r} vs sent {cut(sent)!r} (from character {at})"


class Matcher:
    """An index over one trace's graph for matching prompts; built once per replay source.

    ``match`` walks a prompt from the roots; where several calls answered the same prompt
    (a branch sampled twice, a resend's siblings) ``pick`` chooses among them, so a harness
    that asks the same thing twice gets the recorded answers in their order.
    """

    def __init__(self, trace: Trace, ignore: Ignore = Ignore()) -> None:
        self.trace = trace
        self.ignore = ignore
        self.index: dict[tuple[int | None, str], list[int]] = {}
        self.restated: dict[tuple[int | None, str], list[int]] = {}
        depth: list[int] = []
        for i, node in enumerate(trace.nodes):
            d = 0 if node.parent is None else depth[node.parent] + 1
            depth.append(d)
            self.index.setdefault((node.parent, ignore.message(node.message, d)), []).append(i)
            if node.sampled and node.message.reasoning:
                bare = node.message.model_copy(update={"reasoning": []})
                self.restated.setdefault((node.parent, ignore.message(bare, d)), []).append(i)
        self.answers: dict[int | None, list[ModelCall]] = {}  # prompt's last node -> its calls
        for call in trace.calls:
            if call.node is not None and call.node < len(trace.nodes):
                self.answers.setdefault(trace.nodes[call.node].parent, []).append(call)

    def walk(self, messages: list[Message]) -> list[int]:
        """The longest prefix of ``messages`` found in the graph, as node indices."""
        path: list[int] = []
        parent: int | None = None
        for k, message in enumerate(messages):
            h = self.ignore.message(message, k)
            found = self.index.get((parent, h))
            if not found and message.role == "assistant" and not message.reasoning:
                found = self.restated.get((parent, h))  # a reply restated without its reasoning
            if not found:
                break
            parent = found[0]
            path.append(parent)
        return path

    def match(self, messages: list[Message], tools: list[Tool], dialect: str,
              used: dict[int | None, int] | None = None) -> Hit | Miss:
        """The recorded answer to this prompt, or where it parts from the trace. ``used``
        counts the answers already given per prompt (the caller keeps it per session)."""
        path = self.walk(messages)
        if len(path) == len(messages) and messages:
            last = path[-1]
            calls = [c for c in self.answers.get(last, []) if c.error is None]
            if calls:
                same_dialect = [c for c in calls if c.dialect == dialect]
                if not same_dialect:
                    return Miss(len(messages), None, calls[0], None, None,
                                reason=f"the recorded turn was asked in the {calls[0].dialect} dialect, "
                                       f"this request is {dialect}")
                want = self.ignore.tools(tools)
                fitting = [c for c in same_dialect if self.ignore.tools(self._tools(c)) == want]
                if not fitting:
                    had = [t.name for t in self._tools(same_dialect[0])]
                    return Miss(len(messages), None, same_dialect[0], None, None,
                                reason=f"the tools differ: recorded {had}, sent {[t.name for t in tools]}")
                k = 0
                if used is not None:
                    k = used.get(last, 0)
                    used[last] = k + 1
                call = fitting[min(k, len(fitting) - 1)]
                return Hit(call, self.response(call))
        return self._miss(messages, path)

    def _tools(self, call: ModelCall) -> list[Tool]:
        sets = self.trace.tool_sets
        return sets[call.tool_set] if call.tool_set is not None and call.tool_set < len(sets) else []

    def _miss(self, messages: list[Message], path: list[int]) -> Miss:
        k = len(path)
        nearest = None
        deepest = path[-1] if path else None
        for call in self.trace.calls:  # the first turn whose prompt runs through the shared prefix
            if call.node is None or call.error is not None:
                continue
            if deepest is None or deepest in self.trace.path(call.node)[:-1]:
                nearest = call
                break
        recorded = None
        if nearest is not None:
            prompt = self.trace.path(nearest.node)[:-1]
            if k < len(prompt):
                recorded = self.trace.nodes[prompt[k]].message
        sent = messages[k] if k < len(messages) else None
        return Miss(k, sent.role if sent else None, nearest, recorded, sent, ignore=self.ignore)

    def response(self, call: ModelCall) -> Response:
        """The recorded answer of ``call`` as the canonical response a dialect renders."""
        nodes = self.trace.nodes
        node = nodes[call.node]
        prompt = [nodes[i] for i in self.trace.path(call.node)[:-1]]
        prompt_ids = None
        if prompt and all(n.token_ids is not None for n in prompt):
            prompt_ids = [t for n in prompt for t in n.token_ids]
        return Response(
            id=call.response_id, model=call.model, message=node.message.model_copy(deep=True),
            finish_reason=call.finish_reason, native_finish_reason=call.native_finish_reason,
            usage=call.usage.model_copy() if call.usage else None,
            choices=[Choice(index=j + 1, message=nodes[c].message.model_copy(deep=True),
                            finish_reason=call.finish_reason, token_ids=nodes[c].token_ids,
                            logprobs=nodes[c].logprobs)
                     for j, c in enumerate(call.choice_nodes) if c < len(nodes)],
            prompt_token_ids=prompt_ids, token_ids=node.token_ids, logprobs=node.logprobs,
        )


@dataclass
class Parting:
    """Where two traces part: the turn (0-based, in commit order) and why."""

    turn: int
    calls: tuple[str | None, str | None]
    why: str


@dataclass
class Diff:
    turns: tuple[int, int]
    parting: Parting | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return self.parting is None


def diff(a: Trace, b: Trace, ignore: Ignore = Ignore()) -> Diff:
    """Compare two traces turn by turn (committed calls in order): each turn's dialect,
    prompt, tools, reply and finish reason. The first turn where they part, and why."""
    ta, tb = a.committed_calls, b.committed_calls
    out = Diff((len(ta), len(tb)))
    ma, mb = Matcher(a, ignore), Matcher(b, ignore)
    for t, (ca, cb) in enumerate(zip(ta, tb)):
        why = _turn_diff(a, ca, ma, b, cb, mb, ignore)
        if why:
            out.parting = Parting(t, (ca.id, cb.id), why)
            return out
    if len(ta) != len(tb):
        t = min(len(ta), len(tb))
        longer, ids = ("A", (ta[t].id, None)) if len(ta) > len(tb) else ("B", (None, tb[t].id))
        out.parting = Parting(t, ids, f"{longer} has {abs(len(ta) - len(tb))} more turn(s): "
                                      f"A has {len(ta)}, B has {len(tb)}")
    return out


def _turn_diff(a: Trace, ca: ModelCall, ma: Matcher, b: Trace, cb: ModelCall, mb: Matcher,
               ignore: Ignore) -> str | None:
    if ca.dialect != cb.dialect:
        return f"dialect {ca.dialect} vs {cb.dialect}"
    pa, pb = a.path(ca.node), b.path(cb.node)
    for k in range(max(len(pa), len(pb)) - 1):
        xa = a.nodes[pa[k]].message if k < len(pa) - 1 else None
        xb = b.nodes[pb[k]].message if k < len(pb) - 1 else None
        if xa is None or xb is None:
            return (f"the prompt of A ends after message {k - 1}" if xa is None
                    else f"the prompt of B ends after message {k - 1}")
        if ignore.message(xa, k) != ignore.message(xb, k):
            return f"prompt message {k} ({xa.role} vs {xb.role}) differs: {message_diff(xa, xb, ignore, k)}"
    if ignore.tools(ma._tools(ca)) != ignore.tools(mb._tools(cb)):
        return (f"the tools differ: {[t.name for t in ma._tools(ca)]} vs "
                f"{[t.name for t in mb._tools(cb)]}")
    ra, rb = a.nodes[ca.node].message, b.nodes[cb.node].message
    if ignore.message(ra, len(pa) - 1) != ignore.message(rb, len(pb) - 1):
        return f"the reply differs: {message_diff(ra, rb, ignore, len(pa) - 1)}"
    if ca.finish_reason != cb.finish_reason:
        return f"finish reason {ca.finish_reason} vs {cb.finish_reason}"
    return None
