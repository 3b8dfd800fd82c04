"""A trace as ATIF, the Agent Trajectory Interchange Format harness runners and their viewers
read (schema ``ATIF-v1.8``: https://github.com/harbor-framework/harbor/blob/main/rfcs/0001-trajectory-format.md,
its published pydantic models are the ``atif`` package).

One document per trace, one trajectory per branch (a root-to-leaf path of the message graph).
The root trajectory is the main conversation (the branch of the last committed reply); every
other branch is embedded in ``subagent_trajectories`` of the branch it parts from (the placed
branch it shares the longest prefix with; the main one when it shares nothing, as a sub-agent
with its own system prompt), so a reference resolves where the format says it does. The parent
names the child in an observation result's ``subagent_trajectory_ref`` on the step they part
at: the last step they share, or, sharing nothing, the parent's last step that landed before
the child's first (where the main agent waited on it). The child's shared steps are marked
``is_copied_context`` (a trainer must not learn them twice).

Steps: a system message is a ``system`` step, a user message a ``user`` step, an assistant
message an ``agent`` step (text, reasoning text, tool calls, the call's model, effort and
usage as ``metrics``, and with token ids the prompt's and the completion's ids and logprobs),
and each tool result goes into the ``observation`` of the agent step whose call it answers.
Ours beyond the format go where it allows extensions (``extra``): the node and call ids, the
finish reason, a sampled reply's mask, advantages and trainer arrays, the policy version when
a trace carries one, the rollout's reward, metrics, task and ending at the root.

The document is validated against the ``atif`` package's models before it is handed out, so
what is written is what ATIF readers accept (``RuntimeError`` when the package is missing).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from interceptor.trace.export import chat_tools
from interceptor.trace.messages import Message, Part
from interceptor.trace.model import Branch, ModelCall, Trace

SCHEMA_VERSION = "ATIF-v1.8"
# ATIF's ImageSource admits these media types only; any other image is a text placeholder.
_IMAGE_TYPES = {"image/jpeg", "image/png", "image/gif", "image/webp"}


def require():
    try:
        import atif
    except ImportError as e:
        raise RuntimeError("the atif format needs the atif package: pip install 'llm-interceptor[export]'") from e
    return atif


def trajectory(trace: Trace, *, sampled_only: bool = False) -> dict[str, Any]:
    """The trace as one ATIF document (a JSON-able dict), validated against the published
    models. ``sampled_only`` leaves out branches holding nothing the model produced."""
    atif = require()
    doc = _Builder(trace, sampled_only).document()
    return atif.Trajectory.model_validate(doc).to_json_dict()


def count(doc: dict[str, Any]) -> int:
    """Trajectories in a document (the root and every embedded one)."""
    return 1 + sum(count(sub) for sub in doc.get("subagent_trajectories") or [])


def policy_version(trace: Trace, call: ModelCall | None) -> Any:
    """The version of the policy that sampled ``call``'s reply: its sampled node's (the version
    the upstream said answered, else the one declared when it was sent), else the call's own;
    None when no version was declared. Every agent step carries it in ``extra.policy_version``."""
    if call is None:
        return None
    if call.node is not None and 0 <= call.node < len(trace.nodes):
        version = trace.nodes[call.node].policy_version
        if version is not None:
            return version
    return call.answered_version if call.answered_version is not None else call.policy_version


def _iso(ts: float) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _content(content: str | list[Part]) -> str | list[dict[str, Any]]:
    """Text stays a string; images ATIF can hold become image parts by reference (the trace
    never holds the payload), anything else a text placeholder naming its reference."""
    if isinstance(content, str):
        return content
    if all(p.type == "text" for p in content):
        return "".join(p.text or "" for p in content)
    parts = []
    for p in content:
        if p.type == "text":
            parts.append({"type": "text", "text": p.text or ""})
        elif p.type == "image" and p.ref and p.media_type in _IMAGE_TYPES:
            parts.append({"type": "image", "source": {"media_type": p.media_type, "path": p.ref}})
        else:
            what = " ".join(x for x in (p.type, p.ref or p.media_type) if x)
            parts.append({"type": "text", "text": f"[{what}]"})
    return parts


def _tool_call(call) -> dict[str, Any]:
    """ATIF wants the arguments as an object: a freeform call or arguments that are not a JSON
    object keep the raw text in ``extra.arguments``."""
    out: dict[str, Any] = {"tool_call_id": call.id, "function_name": call.name}
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        args = None
    extra: dict[str, Any] = {}
    if isinstance(args, dict):
        out["arguments"] = args
    else:
        out["arguments"] = {}
        extra["arguments"] = call.arguments
    if call.type != "function":
        extra["type"] = call.type
    if call.namespace:
        extra["namespace"] = call.namespace
    if extra:
        out["extra"] = extra
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Builder:
    """One trace's document: steps per branch, the branch tree, the links."""

    def __init__(self, trace: Trace, sampled_only: bool) -> None:
        self.trace = trace
        self.by_node: dict[int, tuple[ModelCall, str]] = {}  # node -> (call, how it came)
        for call in trace.calls:
            if call.node is not None:
                self.by_node[call.node] = (call, "sampled")
            for n in call.choice_nodes:
                self.by_node[n] = (call, "sampled")
            if call.delivered_node is not None:
                self.by_node[call.delivered_node] = (call, "delivered")
        branches = trace.branches
        if sampled_only:
            branches = [b for b in branches if any(trace.nodes[i].sampled for i in b.nodes)]
        self.branches = branches

    def _main(self) -> Branch:
        last = next((c.delivered_node if c.delivered_node is not None else c.node
                     for c in reversed(self.trace.calls) if c.node is not None), None)
        holding = [b for b in self.branches if last in b.nodes]
        return holding[-1] if holding else self.branches[-1]

    def document(self) -> dict[str, Any]:
        if not self.branches:
            return self._trajectory(None, [], {})
        main = self._main()
        placed = [main]
        parent: dict[int, tuple[Branch, int]] = {}  # branch index -> (parent, shared messages)
        for b in self.branches:
            if b is main:
                continue
            best, shared = main, 0
            for p in placed:
                n = _common_prefix(p.nodes, b.nodes)
                if n > shared:
                    best, shared = p, n
            parent[b.index] = (best, shared)
            placed.append(b)
        built = {b.index: self._steps(b, parent.get(b.index, (None, 0))[1]) for b in self.branches}
        children: dict[int, list[Branch]] = {}
        for b in self.branches:
            if b.index in parent:
                children.setdefault(parent[b.index][0].index, []).append(b)
        for b in self.branches:
            if b.index in parent:
                p, shared = parent[b.index]
                self._link(built[p.index], p, b, shared)
        return self._tree(main, built, children, parent)

    def _tree(self, b: Branch, built, children, parent) -> dict[str, Any]:
        doc = self._trajectory(b, built[b.index][0], parent)
        subs = [self._tree(c, built, children, parent) for c in children.get(b.index, [])]
        if subs:
            doc["subagent_trajectories"] = subs
        return doc

    def _id(self, b: Branch) -> str:
        return f"{self.trace.id}/branch-{b.index}"

    def _link(self, parent_built, p: Branch, child: Branch, shared: int) -> None:
        """A result on the parent's step where the child parts from it, naming the child."""
        steps, node_step = parent_built
        if not steps:
            return
        if shared:
            at = node_step[shared - 1]
        else:
            first = self.trace.nodes[child.nodes[0]].timestamp
            at = 0
            for pos, i in enumerate(p.nodes):
                if self.trace.nodes[i].timestamp <= first:
                    at = node_step[pos]
        step = steps[at]
        results = step.setdefault("observation", {"results": []})["results"]
        results.append({"subagent_trajectory_ref": [{"trajectory_id": self._id(child), "session_id": self.trace.id}],
                        "extra": {"branch": child.index, "shared_messages": shared}})

    def _steps(self, b: Branch, shared: int) -> tuple[list[dict[str, Any]], list[int]]:
        """The branch's steps and, per message of the branch, the index of its step."""
        trace = self.trace
        steps: list[dict[str, Any]] = []
        members: list[list[int]] = []  # per step, the positions of the messages in it
        node_step: list[int] = []
        pending: dict[str, int] = {}  # tool call id -> the agent step that made it
        for pos, i in enumerate(b.nodes):
            node = trace.nodes[i]
            m = node.message
            if m.role == "tool" and m.tool_call_id in pending:
                at = pending[m.tool_call_id]
                steps[at].setdefault("observation", {"results": []})["results"].append(self._result(m, i, True))
            else:
                at = len(steps)
                steps.append(self._step(b, pos, i, m, pending, at))
                members.append([])
            members[at].append(pos)
            node_step.append(at)
        for k, (step, where) in enumerate(zip(steps, members)):
            step["step_id"] = k + 1
            if shared and max(where) < shared:
                step["is_copied_context"] = True
        return steps, node_step

    def _result(self, m: Message, i: int, linked: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"content": _content(m.content)}
        extra: dict[str, Any] = {"node": i}
        if linked:
            out["source_call_id"] = m.tool_call_id
        elif m.tool_call_id:
            extra["tool_call_id"] = m.tool_call_id  # answers no call on this branch
        if m.name:
            extra["name"] = m.name
        if m.is_error:
            extra["is_error"] = True
        out["extra"] = extra
        return out

    def _step(self, b: Branch, pos: int, i: int, m: Message, pending: dict[str, int], at: int) -> dict[str, Any]:
        node = self.trace.nodes[i]
        step: dict[str, Any] = {"step_id": 0}
        ts = _iso(node.timestamp)
        if ts:
            step["timestamp"] = ts
        extra: dict[str, Any] = {"node": i}
        if m.role == "tool":  # a result answering no call on this branch
            step.update(source="system", message="", observation={"results": [self._result(m, i, False)]})
            step["extra"] = extra
            return step
        step["message"] = _content(m.content)
        if m.name:
            extra["name"] = m.name
        if m.role in ("system", "user"):
            step["source"] = m.role
            step["extra"] = extra
            return step
        step["source"] = "agent"
        if m.tool_calls:
            step["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
            pending.update((c.id, at) for c in m.tool_calls)
        if m.refusal:
            extra["refusal"] = m.refusal
        came = self.by_node.get(i)
        extra["sampled"] = node.sampled
        reasoning = "\n".join(r.text for r in m.reasoning if r.text)
        if came is None:
            if reasoning:
                step["reasoning_content"] = reasoning
            step["extra"] = extra
            return step
        call, how = came
        extra["call"] = call.id
        if call.model or call.requested_model:
            step["model_name"] = call.model or call.requested_model
        if how == "delivered":  # a hook's reply, not the model's: no inference made it
            step["llm_call_count"] = 0
            extra["delivered_for"] = call.node
            step["extra"] = extra
            return step
        step["llm_call_count"] = 1
        if reasoning:
            step["reasoning_content"] = reasoning
        if call.sampling.reasoning_effort is not None:
            step["reasoning_effort"] = call.sampling.reasoning_effort
        if call.finish_reason:
            extra["finish_reason"] = call.finish_reason
        if call.native_finish_reason:
            extra["native_finish_reason"] = call.native_finish_reason
        version = policy_version(self.trace, call)
        if version is not None:
            extra["policy_version"] = version
        if call.version_mismatch:
            extra["version_mismatch"] = True  # the upstream answered with other weights than declared
        step["metrics"] = self._metrics(b, pos, i, call)
        step["extra"] = extra
        return step

    def _metrics(self, b: Branch, pos: int, i: int, call: ModelCall) -> dict[str, Any]:
        node = self.trace.nodes[i]
        metrics: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        usage = call.usage
        if usage is not None:
            metrics.update(prompt_tokens=usage.input_tokens, completion_tokens=usage.output_tokens,
                           cached_tokens=usage.cached_input_tokens)
            if usage.reasoning_tokens:
                extra["reasoning_tokens"] = usage.reasoning_tokens
            if usage.cache_creation_input_tokens:
                extra["cache_creation_input_tokens"] = usage.cache_creation_input_tokens
            if usage.estimated:
                extra["usage_estimated"] = True
        if node.token_ids is not None:
            before = [self.trace.nodes[k] for k in b.nodes[:pos]]
            if all(n.token_ids is not None for n in before):
                metrics["prompt_token_ids"] = [t for n in before for t in n.token_ids]
            metrics["completion_token_ids"] = node.token_ids
            if node.logprobs is not None:
                metrics["logprobs"] = node.logprobs
            if node.mask is not None and not all(node.mask):
                extra["completion_mask"] = node.mask
            for name in ("advantages", "reference_logprobs", "loss_weights"):
                if getattr(node, name) is not None:
                    extra[name] = getattr(node, name)
        if extra:
            metrics["extra"] = extra
        return metrics

    def _trajectory(self, b: Branch | None, steps: list[dict[str, Any]], parent) -> dict[str, Any]:
        trace = self.trace
        agent: dict[str, Any] = {"name": str(trace.agent.get("name") or "unknown"),
                                 "version": str(trace.agent.get("version") or "unknown")}
        models = [c.model or c.requested_model for c in trace.calls
                  if b is not None and c.id in b.calls and (c.model or c.requested_model)]
        if models:
            agent["model_name"] = models[-1]
        if b is not None and b.tools:
            agent["tool_definitions"] = chat_tools(b.tools)
        agent_extra = {k: v for k, v in trace.agent.items() if k not in ("name", "version")}
        agent_extra["recorded_by"] = {"producer": trace.producer, "version": trace.producer_version}
        agent["extra"] = agent_extra
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "session_id": trace.id,
                               "agent": agent, "steps": steps}
        own = [s for s in steps if not s.get("is_copied_context") and s.get("metrics")]
        totals = {"total_steps": len(steps)}
        if own:
            for key, field in (("total_prompt_tokens", "prompt_tokens"), ("total_completion_tokens", "completion_tokens"),
                               ("total_cached_tokens", "cached_tokens")):
                totals[key] = sum(s["metrics"].get(field) or 0 for s in own)
        doc["final_metrics"] = totals
        extra: dict[str, Any] = {"trace_id": trace.id}
        if b is not None:
            doc["trajectory_id"] = self._id(b)
            extra.update(branch=b.index, calls=b.calls)
        if b is not None and b.index in parent:
            p, shared = parent[b.index]
            extra.update(parent_branch=p.index, shared_messages=shared)
            doc["notes"] = (f"Branch {b.index} of trace {trace.id}; it parts from branch {p.index} after "
                            f"{shared} shared messages (its steps holding only those are is_copied_context).")
        else:
            extra.update(sealed=trace.sealed, stop_condition=trace.stop_condition, stopped_by=trace.stopped_by,
                         truncated=trace.truncated, reward=trace.reward,
                         rewards={k: r.model_dump(mode="json") for k, r in trace.rewards.items()} or None,
                         metrics=trace.metrics or None, task=trace.task or None, info=trace.info or None)
        doc["extra"] = {k: v for k, v in extra.items() if v is not None}
        return doc
