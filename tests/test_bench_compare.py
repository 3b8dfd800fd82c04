"""bench/compare.py's checks, which decide whether a path's figures count: a path whose trace
holds two turns for one request, that sent the client's model upstream instead of the imposed
one, or the client's key instead of the operator's, must be reported, never benchmarked.
(The benchmark itself is not a test: `make bench`.)"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import compare  # noqa: E402  (bench/compare.py)


def summary(**over):
    base = {"calls": 3, "errors": 0, "turns": 3, "models": ["bench-proxy-1w"], "branches": 3}
    return {**base, **over}


def test_a_trace_with_one_turn_per_request_passes():
    assert compare.trace_problems(summary(), sent=3, model="bench-proxy-1w") == []
    assert compare.trace_problems(summary(calls=20, turns=20, branches=1), sent=20, model="bench-proxy-1w", turns=20) == []


def test_two_turns_for_one_request_is_reported():
    problems = compare.trace_problems(summary(calls=2, turns=2), sent=1, model="bench-proxy-1w")
    assert "2 call(s) recorded for 1 request(s)" in problems
    assert "2 turn(s) for 1 request(s)" in problems


def test_a_retry_answered_from_the_record_is_reported():
    # the clients completed 4, the proxy recorded 3: one was never a turn
    assert compare.trace_problems(summary(), sent=4, model="bench-proxy-1w") != []


def test_an_error_call_a_wrong_model_and_a_forked_rollout_are_reported():
    assert compare.trace_problems(summary(errors=1), sent=3, model="bench-proxy-1w") == ["1 error call(s)"]
    assert compare.trace_problems(summary(models=["gpt-4o"]), sent=3, model="bench-proxy-1w") != []
    assert compare.trace_problems(summary(branches=2), sent=3, model="bench-proxy-1w", turns=3) == [
        "2 branches for one rollout"]


def test_the_simulators_tally_must_match_the_path_claims():
    ok = {("bench-proxy-1w", True): 10}
    assert compare.tally_problems({"bench-proxy-1w": (10, True)}, ok) == []
    # the client's model went upstream: the rewrite did not happen
    assert compare.tally_problems({"bench-proxy-1w": (10, True)}, {("gpt-4o", True): 10}) != []
    # the client's key went upstream instead of the operator's
    assert compare.tally_problems({"bench-proxy-1w": (10, True)}, {("bench-proxy-1w", False): 10}) != []
    # a peer's own retry: the provider was asked twice for one request
    assert compare.tally_problems({"bench-litellm": (10, True)}, {("bench-litellm", True): 11}) != []


def test_the_answer_is_named_by_the_request_and_parsed_back_whole():
    assert len(compare.reply_for([{"content": "tokens=500;000000000001 xxx"}])) == 500
    assert len(compare.reply_for([{"content": "chunk=570; turn 3"}])[0]) == 570
    w = compare.Workload("w", 1, 1, True, 3, False)
    a, b = w.body("m")(), w.body("m")()
    assert a != b  # every request its own body: the same body twice is a retry to the proxy
    lines = ['data: {"choices":[{"delta":{"content":"w0 "}}]}', "", 'data: {"choices":[{"delta":{"content":"w1 "}}]}',
             'data: {"choices":[{"delta":{"content":"w2 "}}]}', 'data: {"choices":[]}', "data: [DONE]"]
    assert compare.parse_answer(True, lines) == (w.expected(), 5)


def test_the_rollout_pairs_each_turn_with_bare_mitmdump():
    """The same request through bare mitmdump and a path, turn by turn: the paired median is
    what the path adds over bare, however much the simulator's time varies from turn to turn
    (which the difference of two bands' p50s carries in full)."""
    import random
    rng = random.Random(7)
    n = 50
    direct = [0.020 + rng.uniform(0, 0.010) for _ in range(n)]
    noise = [rng.uniform(0, 0.010) for _ in range(n)]  # the simulator's time for that turn's body
    bare = [d + 0.004 + x for d, x in zip(direct, noise)]
    proxy = [b + 0.0007 for b in bare]  # exactly 0.7 ms more than bare, every turn
    assert compare.minus_bare(proxy, bare, (0, n)) == "+0.70 (+0.70..+0.70)"
    assert compare.minus_bare(bare, bare, (0, n)) == "-"
    paths = [compare.Path_(name, name, "", "", "", False) for name in ("direct", "bare", "proxy")]
    data = {"direct": {"lat": direct, "cpu": []}, "bare": {"lat": bare, "cpu": [1e6] * n},
            "proxy": {"lat": proxy, "cpu": [2e6] * n}}
    rows = compare.rollout_table(paths, data, band=25)
    head, proxy_row = rows[0], next(r for r in rows if r.startswith("| proxy "))
    assert head.count("|") == proxy_row.count("|")
    # latency, then CPU (1 ms more than bare's every turn), each paired, first and last band
    assert proxy_row.endswith("| +0.70 (+0.70..+0.70) | +0.70 (+0.70..+0.70) | +1.00 (+1.00..+1.00) | +1.00 (+1.00..+1.00) |")
    # without bare in the run, no paired columns
    rows = compare.rollout_table([paths[0], paths[2]], {k: data[k] for k in ("direct", "proxy")}, band=25)
    assert "minus bare" not in rows[0]


def test_the_share_of_bare_pairs_each_repetition():
    """A repetition's throughput against bare mitmdump's in the same repetition: a machine twice
    as fast in the second repetition moves both, not the share (the median of shares of direct
    over mixed minutes would not say 90% here)."""
    bare = [{"n": 100, "wall": 1.0}, {"n": 200, "wall": 1.0}]
    proxy = [{"n": 90, "wall": 1.0}, {"n": 180, "wall": 1.0}]
    assert compare.bare_share(proxy, bare) == [90.0, 90.0]
    assert compare.bare_share(proxy, None) == []
    # the proxy's first cell failed: its second repetition is paired with bare's second
    assert compare.bare_share([{**proxy[1], "rep": 1}], [{**b, "rep": k} for k, b in enumerate(bare)]) == [90.0]
    paths = [compare.Path_(name, name, "", "", "", False) for name in ("direct", "bare", "proxy")]
    w = compare.Workload("JSON, 16 clients", 16, 1, False, 0, True)
    cell = {"lat": [0.01], "first": [], "events": 0, "cpu": 0, "rss": 0}
    cells = {"direct": [{**cell, "n": 300, "wall": 1.0}, {**cell, "n": 300, "wall": 1.0}],
             "bare": [{**cell, **b} for b in bare], "proxy": [{**cell, **p} for p in proxy]}
    rows = compare.cell_table(w, paths, cells)
    assert rows[4].split(" | ")[7] == "90 (90-90)%", rows[4]  # proxy's row, the paired column
    assert rows[3].split(" | ")[7] == "-"  # bare against itself says nothing
