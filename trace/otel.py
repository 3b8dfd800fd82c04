"""A trace as OpenTelemetry GenAI spans, in the OTLP JSON file format (one
``ExportTraceServiceRequest`` per line: what the collector's ``otlpjsonfile`` receiver and file
exporter read; https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding: trace and span
ids in hex, enums as integers, 64-bit integers as strings).

Attributes follow the GenAI semantic conventions (status Development), as the spans page
defines them: https://github.com/open-telemetry/semantic-conventions/blob/main/docs/gen-ai/gen-ai-spans.md
(inference span), .../gen-ai-agent-spans.md (``invoke_agent``), and the input and output
messages JSON schemas beside them (gen-ai-input-messages.json, gen-ai-output-messages.json).
The provider is ``gen_ai.provider.name`` (which replaced ``gen_ai.system``; the conventions
ask an instrumentation not to emit both).

One trace (an OTel trace id derived from the session id, so a re-export gives the same ids)
holds a parent span per session (``invoke_agent``, INTERNAL) and under it one CLIENT span per
model call, named ``{gen_ai.operation.name} {gen_ai.request.model}``. Message content is
opt-in, as the conventions ask (``capture_content``): ``gen_ai.input.messages`` (the prompt:
the reply node's path), ``gen_ai.output.messages`` (the reply and any sibling samples),
``gen_ai.system_instructions`` (Anthropic and Gemini, whose system prompt is not part of the
history) and ``gen_ai.tool.definitions``, each as a JSON string (the conventions' form on spans
while structured span attributes are not generally supported). Ours beyond the conventions are
under ``llm_interceptor.*``.

Every request is checked against ``opentelemetry-proto``'s ``ExportTraceServiceRequest`` before
it is handed out (``RuntimeError`` when the package is missing).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from interceptor.trace._version import VERSION
from interceptor.trace.messages import Message, Part
from interceptor.trace.model import ModelCall, Trace

SPAN_KIND_INTERNAL = 1
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2

# dialect -> gen_ai.provider.name (the conventions' well-known values), gen_ai.operation.name
_PROVIDER = {"chat": "openai", "responses": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini"}
_OPERATION = {"gemini": "generate_content"}
# our finish reasons -> the output messages schema's FinishReason
_FINISH = {"tool_calls": "tool_call"}
# sampling field -> gen_ai.request.* attribute
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_tokens",
             "stop": "stop_sequences", "seed": "seed", "frequency_penalty": "frequency_penalty",
             "presence_penalty": "presence_penalty"}


def require():
    try:
        from google.protobuf import json_format
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as e:
        raise RuntimeError("the otel format needs opentelemetry-proto: pip install 'llm-interceptor[export]'") from e
    return json_format, ExportTraceServiceRequest


def check(request: dict[str, Any]):
    """``request`` parsed as an ``ExportTraceServiceRequest`` (``ValueError`` if it is not one).
    OTLP JSON writes ids in hex where protobuf's own JSON mapping reads base64; the ids are
    turned over before parsing and their lengths checked."""
    json_format, message = require()
    data = json.loads(json.dumps(request))
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key, size in (("traceId", 16), ("spanId", 8), ("parentSpanId", 8)):
                    if span.get(key):
                        raw = bytes.fromhex(span[key])
                        if len(raw) != size:
                            raise ValueError(f"{key} {span[key]!r} is not {size} bytes")
                        span[key] = base64.b64encode(raw).decode()
    try:
        return json_format.ParseDict(data, message())
    except json_format.ParseError as e:
        raise ValueError(f"not an OTLP ExportTraceServiceRequest: {e}") from None


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    if isinstance(v, str):
        return {"stringValue": v}
    return {"stringValue": json.dumps(v, ensure_ascii=False)}


def _attributes(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in attrs.items() if v is not None]


def _nanos(ts: float) -> str:
    return str(round(ts * 1_000_000) * 1000)


def _id(*parts: str, size: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[: size * 2]


def trace_id(trace: Trace) -> str:
    """The OTel trace id of a session: derived from its id, so exports of it agree."""
    return _id("llm-interceptor", trace.id, size=16)


def _part(p: Part) -> dict[str, Any]:
    if p.type == "text":
        return {"type": "text", "content": p.text or ""}
    if p.ref and "://" in p.ref:
        return {"type": "uri", "modality": "image" if p.type == "image" else p.type, "uri": p.ref,
                "mime_type": p.media_type}
    return {"type": p.type, "ref": p.ref, "mime_type": p.media_type}  # a digest: the payload is never kept


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw


def message(m: Message, finish_reason: str | None = None) -> dict[str, Any]:
    """A canonical message in the conventions' message shape (``role``, ``parts``)."""
    parts: list[dict[str, Any]] = []
    if m.role == "tool":
        parts.append({"type": "tool_call_response", "id": m.tool_call_id, "response": m.text()
                      if isinstance(m.content, str) or all(p.type == "text" for p in m.content)
                      else [_part(p) for p in m.content]})
    else:
        for tag, piece in m.pieces():
            if tag == "reasoning":
                if piece.text:
                    parts.append({"type": "reasoning", "content": piece.text})
            elif tag == "content":
                parts.append(_part(piece))
            else:
                parts.append({"type": "tool_call", "id": piece.id, "name": piece.name,
                              "arguments": _arguments(piece.arguments)})
    out: dict[str, Any] = {"role": m.role, "parts": parts}
    if m.name and m.role != "tool":
        out["name"] = m.name
    if finish_reason is not None:
        out["finish_reason"] = _FINISH.get(finish_reason, finish_reason)
    return out


def _content(trace: Trace, call: ModelCall) -> dict[str, Any]:
    """The opt-in content attributes of a call that committed a reply."""
    out: dict[str, Any] = {}
    if call.node is None:
        return out
    prompt = [trace.nodes[i].message for i in trace.path(call.node)[:-1]]
    if (call.upstream_dialect or call.dialect) in ("anthropic", "gemini"):
        lead = 0
        while lead < len(prompt) and prompt[lead].role == "system":
            lead += 1
        if lead:
            out["gen_ai.system_instructions"] = json.dumps(
                [p for m in prompt[:lead] for p in message(m)["parts"]], ensure_ascii=False)
        prompt = prompt[lead:]
    out["gen_ai.input.messages"] = json.dumps([message(m) for m in prompt], ensure_ascii=False)
    replies = [call.node, *call.choice_nodes]
    out["gen_ai.output.messages"] = json.dumps(
        [message(trace.nodes[i].message, call.finish_reason or "stop") for i in replies], ensure_ascii=False)
    if call.tool_set is not None and call.tool_set < len(trace.tool_sets):
        out["gen_ai.tool.definitions"] = json.dumps(
            [{"type": t.type, "name": t.name, "description": t.description, "parameters": t.parameters}
             for t in trace.tool_sets[call.tool_set]], ensure_ascii=False)
    return out


def _call_span(trace: Trace, k: int, call: ModelCall, parent: str, capture_content: bool) -> dict[str, Any]:
    dialect = call.upstream_dialect or call.dialect
    operation = _OPERATION.get(dialect, "chat")
    requested = call.requested_model or call.model
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": _PROVIDER.get(dialect, dialect or "_OTHER"),
        "gen_ai.conversation.id": trace.id,
        "gen_ai.request.model": requested,
        "gen_ai.response.model": call.model,
        "gen_ai.response.id": call.response_id,
    }
    sampling = call.sampling
    for field, name in _SAMPLING.items():
        attrs[f"gen_ai.request.{name}"] = getattr(sampling, field)
    if sampling.top_k is not None:
        attrs["gen_ai.request.top_k"] = float(sampling.top_k)  # a double in the conventions
    if sampling.n is not None and sampling.n != 1:
        attrs["gen_ai.request.choice.count"] = sampling.n
    if call.finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [_FINISH.get(call.finish_reason, call.finish_reason)]
    if call.usage is not None:
        u = call.usage
        attrs["gen_ai.usage.input_tokens"] = u.input_tokens  # cached ones included, as the conventions count
        attrs["gen_ai.usage.output_tokens"] = u.output_tokens
        if u.cached_input_tokens:
            attrs["gen_ai.usage.cache_read.input_tokens"] = u.cached_input_tokens
        if u.cache_creation_input_tokens:
            attrs["gen_ai.usage.cache_creation.input_tokens"] = u.cache_creation_input_tokens
        if u.reasoning_tokens:
            attrs["gen_ai.usage.reasoning.output_tokens"] = u.reasoning_tokens
        if u.estimated:
            attrs["llm_interceptor.usage.estimated"] = True
    failed = call.error is not None or (call.status is not None and call.status >= 400)
    if failed:
        attrs["error.type"] = (call.error.type if call.error is not None else None) or str(call.status)
    attrs.update({
        "http.response.status_code": call.status,
        "llm_interceptor.call.id": call.id,
        "llm_interceptor.dialect": call.dialect,
        "llm_interceptor.upstream_dialect": call.upstream_dialect,
        "llm_interceptor.stream": call.stream,
        "llm_interceptor.node": call.node,
        "llm_interceptor.replay_of": call.replay_of,
        "llm_interceptor.replayed_from": f"{call.replayed_from.trace}/{call.replayed_from.call}"
        if call.replayed_from else None,
        "llm_interceptor.delivered": None if call.delivered else False,
        # The weights: declared when sent, reported by the upstream, and whether they differ.
        "llm_interceptor.policy_version": call.policy_version,
        "llm_interceptor.answered_version": call.answered_version,
        "llm_interceptor.version_mismatch": True if call.version_mismatch else None,
        "llm_interceptor.held_ms": call.held_ms,
    })
    if call.first_byte_at and call.started_at:
        attrs["llm_interceptor.time_to_first_byte"] = round(call.first_byte_at - call.started_at, 6)
    if capture_content:
        attrs.update(_content(trace, call))
    end = call.ended_at or call.first_byte_at or call.started_at
    span: dict[str, Any] = {
        "traceId": trace_id(trace), "spanId": _id(trace.id, str(k), call.id, size=8), "parentSpanId": parent,
        "name": f"{operation} {requested}" if requested else operation, "kind": SPAN_KIND_CLIENT,
        "startTimeUnixNano": _nanos(call.started_at), "endTimeUnixNano": _nanos(end),
        "attributes": _attributes(attrs),
    }
    if failed:
        span["status"] = {"code": STATUS_ERROR, "message": call.error.message if call.error is not None else ""}
    return span


def _session_span(trace: Trace) -> dict[str, Any]:
    starts = [c.started_at for c in trace.calls if c.started_at]
    ends = [c.ended_at or c.started_at for c in trace.calls if c.started_at]
    start = trace.started_at or (min(starts) if starts else 0.0)
    end = trace.ended_at or max([start, *ends])
    agent = trace.agent.get("name")
    usage = trace.usage
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": str(agent) if agent else None,
        "gen_ai.conversation.id": trace.id,
        "gen_ai.usage.input_tokens": usage.input_tokens,  # as billed: restated prefixes counted each call
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "llm_interceptor.trace.id": trace.id,
        "llm_interceptor.turns": trace.num_turns,
        "llm_interceptor.calls": len(trace.calls),
        "llm_interceptor.sealed": trace.sealed,
        "llm_interceptor.stop_condition": trace.stop_condition,
        "llm_interceptor.stopped_by": trace.stopped_by,
        "llm_interceptor.truncated": trace.truncated or None,
        "llm_interceptor.reward": trace.reward,
        "llm_interceptor.rewards": {k: r.model_dump(mode="json") for k, r in trace.rewards.items()} or None,
        "llm_interceptor.metrics": trace.metrics or None,
        "llm_interceptor.task": trace.task or None,
    }
    return {"traceId": trace_id(trace), "spanId": _id(trace.id, "session", size=8),
            "name": f"invoke_agent {agent}" if agent else "invoke_agent", "kind": SPAN_KIND_INTERNAL,
            "startTimeUnixNano": _nanos(start), "endTimeUnixNano": _nanos(end), "attributes": _attributes(attrs)}


def request(trace: Trace, *, capture_content: bool = False) -> dict[str, Any]:
    """The trace as one OTLP ``ExportTraceServiceRequest`` (a JSON-able dict), checked against
    opentelemetry-proto: the session span first, then a span per call in the order they
    were made."""
    session = _session_span(trace)
    spans = [session] + [_call_span(trace, k, c, session["spanId"], capture_content)
                         for k, c in enumerate(trace.calls)]
    out = {"resourceSpans": [{
        "resource": {"attributes": _attributes({"service.name": "llm-interceptor", "service.version": VERSION})},
        "scopeSpans": [{"scope": {"name": "llm-interceptor", "version": VERSION}, "spans": spans}],
    }]}
    check(out)
    return out
