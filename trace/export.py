"""Export formats a trainer reads: JSON lines, Parquet, and chat conversations.

One row per branch (a root-to-leaf path of the message graph: one training sample). The
JSONL row is the reference (built by ``replay_trace.py``'s ``samples``); the other formats
are that row in another shape, so a filter or a new field applies to all of them:

- ``jsonl``: the row as one JSON line.
- ``parquet`` (needs the ``parquet`` extra, pyarrow): ``PARQUET_SCHEMA``, stable across
  files so a trainer's dataset loader can concatenate them. Token arrays are list columns
  (``token_ids`` list<int64>, ``sampled_mask`` list<bool>, ``logprobs`` and ``advantages``
  list<float64>, null when the upstream returned no token ids); free-form fields
  (``messages``, ``tools``, ``metrics``, ``task``, and any field a later version adds) are
  JSON text, because their shape varies by dialect and harness and a nested Arrow type
  inferred per file would differ between files. Read back, ``json.loads`` of those columns
  gives the JSONL row exactly.
- ``messages``: the branch as an OpenAI-style chat conversation (``messages`` and ``tools``
  in Chat Completions shape: assistant ``tool_calls`` with ``function.name/arguments``,
  ``tool`` messages with ``tool_call_id`` and ``name``, reasoning text as
  ``reasoning_content``, the key Hugging Face chat templates read), ready for
  ``tokenizer.apply_chat_template`` or SFT. Freeform (``custom``) tool calls are written as
  functions whose ``arguments`` is the raw input text: chat templates know only functions.
  ``message_versions`` keeps, message by message, the weights version that sampled it.

Every format keeps the policy versions: ``policy_versions`` (token by token, beside
``token_ids``) and ``message_versions`` (one per message), JSON text in parquet since a
version is a number or a name.

The formats other tools read, a document per trace (ATIF, OpenTelemetry), are
``interchange.py``'s.

Filters: ``sampled_only`` keeps branches with at least one message the model produced (a
branch that is only restated context, such as a compaction prompt that got no answer, has
nothing to learn from); ``min_reward`` keeps rollouts whose reward is at least that (an
unrewarded trace never passes a reward filter).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import IO, Any

from interceptor.trace.messages import Message, Tool
from interceptor.trace.model import Trace

FORMATS = ("jsonl", "parquet", "messages")

# name -> Arrow type name; everything else in a row is a JSON string column.
_TYPED = {
    "trace_id": "string",
    "branch": "int64",
    "token_ids": "list<int64>",
    "sampled_mask": "list<bool>",
    "logprobs": "list<float64>",
    "advantages": "list<float64>",
    "reward": "float64",
    "calls": "list<string>",
}
JSON_COLUMNS = ("messages", "tools", "metrics", "task")


def filtered(trace: Trace, rows: Iterable[dict[str, Any]], *, sampled_only: bool = False,
             min_reward: float | None = None) -> Iterator[dict[str, Any]]:
    """The rows (one per branch, with its ``branch`` index) that pass the export filters
    (see the module docstring)."""
    if min_reward is not None and (trace.reward is None or trace.reward < min_reward):
        return
    sampled = None
    if sampled_only:
        sampled = {b.index for b in trace.branches if any(trace.nodes[i].sampled for i in b.nodes)}
    for row in rows:
        if sampled is None or row["branch"] in sampled:
            yield row


# --- messages -------------------------------------------------------------------------------


def chat_tools(tools: Iterable[Tool | dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in Chat Completions shape."""
    out = []
    for t in tools:
        tool = t if isinstance(t, Tool) else Tool.model_validate(t)
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out


def chat_messages(messages: Iterable[Message | dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages as an OpenAI-style chat conversation (see the module docstring)."""
    names: dict[str, str] = {}  # tool call id -> tool name, for the tool message's ``name``
    out = []
    for m in messages:
        msg = m if isinstance(m, Message) else Message.model_validate(m)
        item: dict[str, Any] = {"role": msg.role, "content": _content(msg)}
        if msg.role == "assistant":
            reasoning = "\n".join(r.text for r in msg.reasoning if r.text)
            if reasoning:
                item["reasoning_content"] = reasoning
            if msg.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in msg.tool_calls]
                names.update((c.id, c.name) for c in msg.tool_calls)
            if msg.refusal:
                item["refusal"] = msg.refusal
        elif msg.role == "tool":
            item["tool_call_id"] = msg.tool_call_id
            name = msg.name or names.get(msg.tool_call_id or "")
            if name:
                item["name"] = name
        elif msg.name:
            item["name"] = msg.name
        out.append(item)
    return out


def _content(msg: Message) -> str | list[dict[str, Any]]:
    """Plain text when the message is text only (what chat templates expect); else Chat's
    content parts, an image or file by its reference (the trace never holds the payload)."""
    if isinstance(msg.content, str) or all(p.type == "text" for p in msg.content):
        return msg.text()
    parts = []
    for p in msg.content:
        if p.type == "text":
            parts.append({"type": "text", "text": p.text or ""})
        elif p.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": p.ref or ""}})
        else:
            parts.append({"type": "text", "text": f"[{p.type} {p.ref or p.media_type or ''}]".replace(" ]", "]")})
    return parts


def messages_row(row: dict[str, Any]) -> dict[str, Any]:
    """A JSONL row (``samples``) as a chat conversation row."""
    out = {"trace_id": row["trace_id"], "branch": row["branch"],
           "messages": chat_messages(row["messages"]), "tools": chat_tools(row.get("tools") or [])}
    for key in ("reward", "metrics", "task", "message_versions"):
        out[key] = row.get(key)
    return out


# --- parquet --------------------------------------------------------------------------------


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise RuntimeError("the parquet format needs pyarrow: pip install 'llm-interceptor[parquet]'") from e
    return pyarrow


def parquet_schema(columns: Iterable[str]):
    """The Arrow schema of rows with these keys: typed columns as documented, JSON text for
    the rest."""
    pa = _pyarrow()
    types = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(),
             "list<int64>": pa.list_(pa.int64()), "list<bool>": pa.list_(pa.bool_()),
             "list<float64>": pa.list_(pa.float64()), "list<string>": pa.list_(pa.string())}
    return pa.schema([pa.field(c, types[_TYPED.get(c, "string")]) for c in columns])


def _parquet_value(column: str, value: Any) -> Any:
    if column in _TYPED or value is None:
        return value
    return json.dumps(value, ensure_ascii=False)


# --- writers --------------------------------------------------------------------------------


class Writer:
    """Rows of one format to one file; ``write`` per trace, ``close`` at the end."""

    def __init__(self, fmt: str, out: IO[str] | str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
        self.format = fmt
        self.count = 0
        self._parquet = None
        self._columns: list[str] | None = None
        if fmt == "parquet":
            if not isinstance(out, str) or out == "-":
                raise ValueError("parquet needs a file path (--out), not stdout")
            _pyarrow()
            self._path = out
            self._out = None
        else:
            self._out = open(out, "w", encoding="utf-8") if isinstance(out, str) else out
        self._own = isinstance(out, str)

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        if not rows:
            return
        self.count += len(rows)
        if self.format == "parquet":
            self._write_parquet(rows)
            return
        for row in rows:
            if self.format == "messages":
                row = messages_row(row)
            self._out.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _write_parquet(self, rows: list[dict[str, Any]]) -> None:
        pa = _pyarrow()
        if self._columns is None:
            self._columns = list(rows[0])
            self._parquet = pa.parquet.ParquetWriter(self._path, parquet_schema(self._columns))
        extra = set(rows[0]) - set(self._columns)
        if extra:
            raise ValueError(f"rows gained fields {sorted(extra)} mid-export; one file has one schema")
        data = {c: [_parquet_value(c, r.get(c)) for r in rows] for c in self._columns}
        self._parquet.write_table(pa.table(data, schema=self._parquet.schema))

    def close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        elif self.format == "parquet":  # no rows at all: still a readable, empty file
            pa = _pyarrow()
            pa.parquet.write_table(parquet_schema(list(_TYPED) + list(JSON_COLUMNS)).empty_table(), self._path)
        if self._out is not None and self._own:
            self._out.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_parquet(path: str) -> list[dict[str, Any]]:
    """Rows of a parquet export as the JSONL rows they came from (JSON columns decoded)."""
    pa = _pyarrow()
    table = pa.parquet.read_table(path)
    rows = table.to_pylist()
    for row in rows:
        for key, value in row.items():
            if key not in _TYPED and value is not None:
                row[key] = json.loads(value)
    return rows
