"""Grow a Trace's message graph one turn at a time.

Harnesses restate the whole history on every request. Storing each request would make a
300-turn rollout quadratic; instead each turn's prompt is walked from the roots by message
hash, the matching prefix is reused, and only the new tail and the sampled reply become
nodes. Where a prompt parts from every stored path (compaction, a sub-agent, an edited
history) the new nodes hang off the last shared node, so the shared prefix exists once and
the split shows as a second leaf.

Token ids (when the upstream returns them) refine "matching": a stored node is reused only if
its token ids are exactly the tokens the new prompt has at that position. If the chat template
renders a past message differently now (retokenisation, e.g. a template that strips old
reasoning), the turn branches at that node rather than inheriting tokens the model never saw.

A restated reply that carries no reasoning at all matches its sampled node even though that
node has reasoning: Chat harnesses do not send vLLM's ``reasoning_content`` back, and without
this every turn of a reasoning model would start a new branch. The node keeps what the model
produced. A restatement with *different* reasoning is a different message and branches; with
token ids, the tokens decide as above (a template that rendered no reasoning does not fit).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from interceptor.trace.messages import Message, cached_hash, message_hash, restated_hash
from interceptor.trace.model import MessageNode, Trace
from interceptor.trace.shared import shared


@dataclass
class TurnNodes:
    """What one turn added: ``sampled`` is the reply's node, ``added`` every new node index
    in creation order (a reused reply is not in it), ``prompt_path`` the prompt's nodes."""

    sampled: int
    added: list[int] = field(default_factory=list)
    prompt_path: list[int] = field(default_factory=list)
    choices: list[int] = field(default_factory=list)


#: Up to this many children are compared directly with a message whose hash is not yet
#: known (cheaper than hashing it); beyond it the hash index decides alone.
FEW_CHILDREN = 4


_same = operator.is_


class KnownIds(list):
    """A prompt's token ids whose first ``count`` are the very ids stored along the graph path
    to ``leaf`` (which was ``node``), and all ints: the reader of vLLM's bytes took them from
    there (``dialects/prompt_ids.py``) and checked the rest. ``Graph.add_turn`` then needs no
    comparison of those ids with the nodes', and a Response takes the list without pydantic's
    check of each id. Where those ids came from is only a claim about this graph: the node is
    checked to still be there."""

    __slots__ = ("leaf", "node", "count")

    def __init__(self, leaf: int, node: MessageNode) -> None:
        super().__init__()
        self.leaf, self.node, self.count = leaf, node, 0


class Graph:
    """An index over ``trace.nodes`` keyed by (parent, message hash).

    The index is rebuilt from the nodes, so a graph can be resumed from a folded file. Several
    nodes may share a key (a retokenised copy, two different samples that happen to be equal
    text but different tokens); they are kept in creation order.
    """

    def __init__(self, trace: Trace):
        self.trace = trace
        self.index: dict[tuple[int | None, str], list[int]] = {}
        # sampled replies with reasoning, by the hash of their restatement without it
        self.restated: dict[tuple[int | None, str], list[int]] = {}
        self.children: dict[int | None, list[int]] = {}
        # Nodes ``_first`` found to be the walk's pick for their own message object: that
        # stays true (a candidate list only grows at its end; a rollback builds a new Graph),
        # so a prompt that restates the same objects is not looked up again (``_fitting``).
        self.firsts: dict[int, MessageNode] = {}
        # The last path ``_fitting`` found the walk would take whole: (its last node, its
        # nodes, the message objects it was taken for, the ids they cover). The next prompt's
        # known ids usually name a path that goes on from it, and for its first nodes it is
        # enough to see the same message objects again (``_fitting``).
        self._fit: tuple[int, list[int], list[Message], int] | None = None
        for i, node in enumerate(trace.nodes):
            self._index(i, node)

    def _index(self, i: int, node: MessageNode) -> None:
        h = message_hash(node.message)
        self.index.setdefault((node.parent, h), []).append(i)
        self.children.setdefault(node.parent, []).append(i)
        bare = restated_hash(node.message) if node.sampled else None
        if bare is not None:
            self.restated.setdefault((node.parent, bare), []).append(i)

    def _add(self, node: MessageNode, added: list[int]) -> int:
        i = len(self.trace.nodes)
        self.trace.nodes.append(node)
        self._index(i, node)
        added.append(i)
        return i

    def add_turn(
        self,
        prompt: list[Message],
        reply: Message,
        *,
        prompt_token_ids: list[int] | None = None,
        token_ids: list[int] | None = None,
        logprobs: list[float] | None = None,
        choices: list[tuple[Message, list[int] | None, list[float] | None]] = (),
        now: float | None = None,
        known: Sequence[int] = (),
    ) -> TurnNodes:
        """Add one turn; return the node indices it used and created.

        Prompt tokens beyond the reused prefix go onto the last new prompt node (which thus
        also holds the generation scaffold such as ``<|im_start|>assistant\\n``); earlier new
        nodes of the same turn get ``[]``. Without a tokenizer the per-message boundaries are
        unknown, and putting the whole tail on the last node keeps every path's concatenation
        exact, which is what a trainer needs.
        """
        now = time.time() if now is None else now
        nodes = self.trace.nodes
        added: list[int] = []
        path: list[int] = []
        parent: int | None = None
        consumed = 0  # prompt tokens covered by the reused prefix
        k = 0
        if known and len(known) <= len(prompt) and known[-1] < len(nodes):
            k, consumed = (len(known), 0) if prompt_token_ids is None else self._fitting(known, prompt_token_ids, prompt)
            if k:
                path = list(known[:k])
                parent = path[-1]
        while k < len(prompt):
            match = self._match(parent, prompt[k], prompt_token_ids, consumed)
            if match is None:
                break
            path.append(match)
            parent = match
            if prompt_token_ids is not None:
                consumed += len(nodes[match].token_ids)
            k += 1

        tail = prompt_token_ids[consumed:] if prompt_token_ids is not None else None
        if tail and k == len(prompt) and path:
            # The whole prompt matched yet tokens remain (the prompt ends at a stored reply,
            # so the scaffold after it is new): re-create the last node to carry them.
            last = path.pop()
            k -= 1
            parent = nodes[last].parent
            consumed -= len(nodes[last].token_ids)
            tail = prompt_token_ids[consumed:]

        if tail or type(prompt_token_ids) is KnownIds:
            # Kept as long as the session lives: each id the process's one object (trace/shared.py),
            # in the prompt's list too when the session keeps it for the next prompt
            # (``KnownIds``: its first ``count`` are the nodes' already).
            start = min(prompt_token_ids.count, consumed) if type(prompt_token_ids) is KnownIds else consumed
            shared(prompt_token_ids, start)
            tail = prompt_token_ids[consumed:]
        new = prompt[k:]
        for j, message in enumerate(new):
            ids = None
            if tail is not None:
                ids = tail if j == len(new) - 1 else []
            node = MessageNode(
                parent=parent, message=message, timestamp=now,
                token_ids=ids, mask=[False] * len(ids) if ids is not None else None,
            )
            parent = self._add(node, added)
            path.append(parent)

        sampled = self._add_reply(parent, reply, token_ids, logprobs, now, added)
        extra = [self._add_reply(parent, m, t, lp, now, added) for m, t, lp in choices]
        return TurnNodes(sampled=sampled, added=added, prompt_path=path, choices=extra)

    def lineage(self, index: int) -> list[int]:
        """Node indices from the root down to ``index``: ``Trace.path`` without its guard
        against a cycle, which a graph grown here cannot have (a node's parent is an older
        node), and so without its set of the nodes seen."""
        nodes = self.trace.nodes
        out = []
        cur: int | None = index
        while cur is not None:
            out.append(cur)
            cur = nodes[cur].parent
        out.reverse()
        return out

    def _fitting(self, known: Sequence[int], ids: list[int], prompt: list[Message]) -> tuple[int, int]:
        """How many of the ``known`` nodes (the prompt's leading messages, whose nodes are
        known) the walk would take with these token ids, and how many ids they cover,
        without comparing any ids: the leading nodes of the path ``KnownIds`` says its first
        ids came from (the last prompt's), when ``known`` begins with it, as far as the walk
        would pick each (``_first``). Their ids fit, being the prompt's; but the walk takes
        the *first* candidate that fits, and an earlier one may fit too (a node stored with
        ``[]``, an earlier new message of its turn, fits anywhere): from the first node that
        is not sure to be the walk's choice, the walk decides as it would have."""
        nodes = self.trace.nodes
        if type(ids) is not KnownIds or ids.leaf >= len(nodes) or nodes[ids.leaf] is not ids.node:
            return 0, 0
        leaf = ids.leaf
        # The path to ``leaf``: usually the last fitting path and the few nodes the turn
        # after it added. Walking the whole path up from its leaf, and checking each node
        # again, would touch every node object of the conversation each turn (cache misses).
        fit, k, consumed, path, taken = self._fit, 0, 0, None, None
        if fit is not None and fit[0] <= leaf:
            up, cur = [], leaf
            while cur is not None and cur > fit[0]:  # a parent is always an older node
                up.append(cur)
                cur = nodes[cur].parent
            if cur == fit[0]:
                path, taken = fit[1], fit[2]
                d = len(path)
                up.reverse()
                if (d + len(up) <= len(known) and known[:d] == path and known[d:d + len(up)] == up
                        and all(map(_same, taken, prompt))):
                    k, consumed = d, fit[3]
                    path.extend(up)  # the memo's own lists, grown in place
                else:
                    path = taken = None
        if path is None:
            path = self.lineage(leaf)
            if len(path) > len(known) or known[:len(path)] != path:
                return 0, 0
        firsts = self.firsts
        for i in path[k:]:
            node, message = nodes[i], prompt[k]
            if node.message is not message or firsts.get(i) is not node:
                if not self._first(i, message):
                    break
                if node.message is message:
                    firsts[i] = node
            consumed += len(node.token_ids)
            k += 1
        if k == len(path):
            if taken is None:
                taken = prompt[:k]
            else:
                taken.extend(prompt[len(taken):k])
            self._fit = (leaf, path, taken, consumed)
        else:
            self._fit = None  # ``path`` may be the memo's, grown past what fits
        return k, consumed

    def _first(self, i: int, message: Message) -> bool:
        """Whether node ``i``, which holds ``message`` (or the sampled reply it restates
        without reasoning) and whose ids fit, is what ``_match`` returns for it: no candidate
        it tries before ``i`` may be there. Usually ``message`` is the node's own object (the
        recorder hands the graph's messages back) and one index lookup says so."""
        node = self.trace.nodes[i]
        if node.message is message:
            return self.index.get((node.parent, message_hash(message)), (None,))[0] == i
        h = message_hash(message)
        same = self.index.get((node.parent, h))
        if same:  # the equal candidates come first, then any of the same hash
            return same[0] == i and node.message == message
        return (message.role == "assistant" and not message.reasoning
                and self.restated.get((node.parent, h), (None,))[0] == i)

    def add_prompt(self, prompt: list[Message], *, now: float | None = None) -> tuple[list[int], list[int]]:
        """A prompt that got no reply (a refused request): the stored prefix is reused and
        its new messages become nodes, so the trace ends where the harness was. Returns
        (added node indices, the prompt's path).

        No model read the new messages, so under a prefix with token ids they get ``[]``
        (no tokens were fed): the branch stays a training sample instead of losing its
        token arrays to a tail that was never tokenised."""
        now = time.time() if now is None else now
        added: list[int] = []
        path: list[int] = []
        parent: int | None = None
        for message in prompt:
            match = None if added else self._match(parent, message, None, 0)
            if match is None:
                known = parent is not None and self.trace.nodes[parent].token_ids is not None
                node = MessageNode(parent=parent, message=message, timestamp=now,
                                   token_ids=[] if known else None, mask=[] if known else None)
                match = self._add(node, added)
            path.append(match)
            parent = match
        return added, path

    def _match(self, parent: int | None, message: Message,
               prompt_token_ids: list[int] | None, consumed: int) -> int | None:
        """The stored child of ``parent`` that is ``message`` (and, with token ids, carries
        exactly the prompt's tokens at this position), or None.

        O(1) on average however many children ``parent`` has: a session reused for
        thousands of independent requests has thousands of roots, and scanning them for
        every message made each turn linear in the session's age. The (parent, hash) index
        is asked first; among its candidates an equal message is preferred, so the choice is
        the one a scan of every child would make (equal messages hash equal). Only a message
        whose hash is not known yet, among a handful of children, is compared directly first:
        comparing costs less than hashing a freshly parsed message, and a restated history
        is usually the very same content. A reply restated without any reasoning is looked
        up among the sampled replies that had some (see the module docstring).
        """
        nodes = self.trace.nodes

        def fits(cand: int) -> bool:
            if prompt_token_ids is None:
                return True
            ids = nodes[cand].token_ids
            return ids is not None and prompt_token_ids[consumed:consumed + len(ids)] == ids

        if cached_hash(message) is None:
            kids = self.children.get(parent, ())
            if len(kids) <= FEW_CHILDREN:
                for cand in kids:
                    if nodes[cand].message == message and fits(cand):
                        return cand
        h = message_hash(message)
        same = self.index.get((parent, h), ())
        for cand in same:
            if nodes[cand].message == message and fits(cand):
                return cand
        for cand in same:
            if fits(cand):
                return cand
        if message.role == "assistant" and not message.reasoning:
            for cand in self.restated.get((parent, h), ()):
                if fits(cand):
                    return cand
        return None

    def add_delivered(self, sampled: int, message: Message, added: list[int], *, now: float | None = None) -> int:
        """The reply a response hook delivered instead of the sampled node ``sampled``: a
        non-sampled sibling, which the next turn's restatement matches (by hash) and extends.
        Under token ids it gets ``[]``: no model produced it, and whatever tokens the template
        renders it as next turn go onto that turn's first new node, mask false (context).
        An identical delivered sibling is reused."""
        nodes = self.trace.nodes
        parent = nodes[sampled].parent
        ids = [] if nodes[sampled].token_ids is not None else None
        for cand in self.index.get((parent, message_hash(message)), ()):
            if not nodes[cand].sampled and nodes[cand].token_ids == ids:
                return cand
        node = MessageNode(parent=parent, message=message, timestamp=time.time() if now is None else now,
                           token_ids=ids, mask=[] if ids is not None else None)
        i = self._add(node, added)
        bare = restated_hash(message)  # a Chat harness restates it without reasoning, like a sampled reply
        if bare is not None:
            self.restated.setdefault((parent, bare), []).append(i)
        return i

    def _add_reply(self, parent, reply, token_ids, logprobs, now, added) -> int:
        """The sampled node; an identical earlier sample (same text and tokens) is reused so
        the tree keeps one node per distinct path."""
        for cand in self.index.get((parent, message_hash(reply)), ()):
            node = self.trace.nodes[cand]
            if node.sampled and node.token_ids == token_ids and node.logprobs == logprobs:
                return cand
        node = MessageNode(
            parent=parent, message=reply, sampled=True, timestamp=now,
            token_ids=shared(token_ids),
            mask=[True] * len(token_ids) if token_ids is not None else None,
            logprobs=logprobs,
        )
        return self._add(node, added)
