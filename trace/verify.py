"""Integrity checks of a folded Trace, shared by ``replay_trace.py verify`` and the tests.

A trace is trusted by trainers without a second look, so what must hold is checked in one
place: the graph is a forest (parents exist and come first, so no cycles), every call points
at a sampled node (and a response hook's delivered reply at a non-sampled sibling of it), and token arrays line up wherever token ids are present.
"""

from __future__ import annotations

from interceptor.trace.model import Trace


def problems(trace: Trace) -> list[str]:
    """Every problem found, in a stable order; empty when the trace is sound."""
    out: list[str] = []
    n = len(trace.nodes)
    for i, node in enumerate(trace.nodes):
        if node.parent is not None and not 0 <= node.parent < i:
            # Nodes are appended after their parent, so a parent at or after its child is
            # either missing or a cycle.
            out.append(f"node {i}: parent {node.parent} does not precede it")
        ids = node.token_ids
        for name in ("mask", "logprobs", "advantages", "reference_logprobs", "loss_weights"):
            arr = getattr(node, name)
            if arr is not None and (ids is None or len(arr) != len(ids)):
                out.append(f"node {i}: {name} has {len(arr)} entries for "
                           f"{'no' if ids is None else len(ids)} token ids")
        if node.mask is not None and any(node.mask) and not node.sampled:
            out.append(f"node {i}: mask marks tokens sampled on a node the model did not produce")
    seen: set[str] = set()
    for call in trace.calls:
        if call.id in seen:
            out.append(f"call {call.id}: id recorded twice")
        seen.add(call.id)
        for ref in ([call.node] if call.node is not None else []) + call.choice_nodes:
            if not 0 <= ref < n:
                out.append(f"call {call.id}: node {ref} does not exist")
            elif not trace.nodes[ref].sampled:
                out.append(f"call {call.id}: node {ref} is not a sampled reply")
        if call.delivered_node is not None:
            d = call.delivered_node
            if call.node is None or not 0 <= d < n:
                out.append(f"call {call.id}: delivered node {d} has no sampled node beside it"
                           if call.node is None else f"call {call.id}: delivered node {d} does not exist")
            elif trace.nodes[d].sampled or any(trace.nodes[d].mask or ()):
                out.append(f"call {call.id}: delivered node {d} is marked sampled; a response hook's "
                           "replacement is context, not a sample")
            elif 0 <= call.node < n and trace.nodes[d].parent != trace.nodes[call.node].parent:
                out.append(f"call {call.id}: delivered node {d} is not a sibling of its sampled node {call.node}")
        if call.tool_set is not None and not 0 <= call.tool_set < len(trace.tool_sets):
            out.append(f"call {call.id}: tool set {call.tool_set} is not recorded")
        if call.replay_of is not None and call.replay_of not in seen:
            out.append(f"call {call.id}: replays {call.replay_of}, which is not recorded before it")
    if out:
        return out  # branch views assume a sound graph
    for b in trace.branches:
        if b.token_ids is None:
            continue
        lengths = {len(a) for a in (b.token_ids, b.sampled_mask, b.logprobs, b.advantages,
                                    b.reference_logprobs, b.loss_weights) if a is not None}
        if len(lengths) != 1:
            out.append(f"branch {b.index}: token arrays differ in length {sorted(lengths)}")
    return out
