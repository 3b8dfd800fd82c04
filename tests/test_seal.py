"""The end of a rollout: ``DELETE /_interceptor/sessions/<id>`` takes the
evaluator's stop condition, reward, named rewards, metrics and info into the footer; the
footer says who stopped the rollout, whether it was cut short, and where the time went.

Through a real mitmdump and the real openai SDK; the footer is read back from the file.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from interceptor.trace import Recorder, Store, read_trace
from clients import session_clients
from mitm import ROOT
from provider import Reply

REPLAY = [sys.executable, str(ROOT / "scripts" / "replay_trace.py")]


def _one_turn(session, sim, harness_env) -> None:
    harness_env(session["env"])
    sim.script(Reply(text="done"))
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])


def test_delete_body_lands_in_the_footer(new_session, sim, proxy, harness_env):
    session = new_session(info={"split": "train"})
    _one_turn(session, sim, harness_env)
    body = {"stop_condition": "task_solved", "rewards": {"tests": {"score": 1.0, "weight": 0.75},
                                                         "style": {"score": 0.5}},
            "metrics": {"tests_passed": 7}, "info": {"grader": "pytest"}}
    status, summary = proxy.api("DELETE", f"sessions/{session['id']}", body)
    assert status == 200, summary
    # no explicit reward: the weighted sum of the named ones
    assert summary["reward"] == pytest.approx(1.0 * 0.75 + 0.5 * 1.0)
    assert summary["stop_condition"] == "task_solved" and summary["stopped_by"] == "control"
    trace = read_trace(session["trace_path"])
    assert trace.sealed and trace.stop_condition == "task_solved" and trace.stopped_by == "control"
    assert trace.truncated is False
    assert trace.reward == pytest.approx(1.25)
    assert {k: (r.score, r.weight) for k, r in trace.rewards.items()} == {"tests": (1.0, 0.75), "style": (0.5, 1.0)}
    assert trace.metrics == {"tests_passed": 7}
    assert trace.info == {"split": "train", "grader": "pytest"}  # laid over the header's
    t = trace.timing
    call = trace.calls[0]
    assert t is not None and t.model == pytest.approx(call.duration) and t.model > 0
    assert t.wall >= t.model and t.harness == pytest.approx(t.wall - t.model)
    assert t.first_request_at == call.started_at and t.last_answer_at == call.ended_at
    assert trace.started_at <= t.first_request_at <= t.last_answer_at <= trace.ended_at
    text = subprocess.run([*REPLAY, "show", session["trace_path"]], capture_output=True, text=True, check=True).stdout
    assert "stopped task_solved by control" in text and "reward 1.25" in text and "tests 1x0.75" in text
    shown = json.loads(subprocess.run([*REPLAY, "show", "--json", session["trace_path"]],
                                      capture_output=True, text=True, check=True).stdout)
    assert shown["stopped_by"] == "control" and shown["rewards"]["style"] == {"score": 0.5, "weight": 1.0}


def test_an_explicit_reward_wins_over_the_sum(new_session, sim, proxy, harness_env):
    session = new_session()
    _one_turn(session, sim, harness_env)
    status, summary = proxy.api("DELETE", f"sessions/{session['id']}",
                                {"reward": -1, "rewards": {"a": {"score": 3}}})
    assert status == 200 and summary["reward"] == -1.0
    trace = read_trace(session["trace_path"])
    assert trace.reward == -1.0 and trace.rewards["a"].score == 3
    assert trace.stop_condition == "deleted"  # no stop condition given: the DELETE's own


@pytest.mark.parametrize("body, says", [
    ({"rewrad": 1.0}, "rewrad"),  # a typo must not seal a rollout without its reward
    ({"rewards": {"a": {"score": 1, "wieght": 2}}}, "wieght"),
    ({"rewards": {"a": {"weight": 2}}}, "score"),
    ({"reward": "high"}, "reward"),
    ({"stop_condition": ""}, "stop_condition"),
])
def test_a_bad_delete_body_is_400_and_seals_nothing(new_session, sim, proxy, harness_env, body, says):
    session = new_session()
    _one_turn(session, sim, harness_env)
    status, answer = proxy.api("DELETE", f"sessions/{session['id']}", body)
    assert status == 400 and says in answer["error"]["message"], answer
    status, summary = proxy.api("GET", f"sessions/{session['id']}")
    assert status == 200 and summary["sealed"] is False
    # the rollout goes on: the harness is still served
    sim.script(Reply(text="again"))
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi again"}])
    status, summary = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200 and summary["turns"] == 2


def test_a_non_finite_reward_is_refused(new_session, proxy):
    # Python's json reads NaN; a NaN reward would poison every mean a trainer takes.
    session = new_session()
    import urllib.request
    req = urllib.request.Request(f"{proxy.url}/_interceptor/sessions/{session['id']}", method="DELETE",
                                 data=b'{"reward": NaN}', headers={"Authorization": f"Bearer {proxy.admin_token}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"reward" in e.value.read()


def test_footer_round_trip_in_process(tmp_path):
    """The recorder's footer folds back into the same Trace fields (no proxy)."""
    store = Store()
    rec = Recorder(tmp_path / "t.msgpack", {"id": "t", "info": {"a": 1}}, store=store)
    rec.trace.metrics["from_hook"] = 2  # what record_metric collects during the rollout
    rec.seal("max_turns", rewards={"x": {"score": 2.0, "weight": 0.5}}, metrics={"m": 1},
             info={"b": 2}, stopped_by="limit", truncated=True)
    rec.seal("again")  # idempotent
    store.close()
    trace = read_trace(tmp_path / "t.msgpack")
    assert (trace.stop_condition, trace.stopped_by, trace.truncated) == ("max_turns", "limit", True)
    assert trace.reward == 1.0 and trace.metrics == {"from_hook": 2, "m": 1}
    assert trace.info == {"a": 1, "b": 2}
    assert trace.timing is not None and trace.timing.model == 0 and trace.timing.first_request_at is None
