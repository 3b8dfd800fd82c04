"""Write ``tests/data/trace-v<SCHEMA_VERSION>.msgpack``: a trace the real proxy recorded, kept
so that later readers prove they still fold what this version wrote.

    .venv/bin/python tests/data/make_golden.py

Run it once when the schema version moves on (it refuses to overwrite a file); ``--out NAME``
writes the trace to ``tests/data/NAME`` instead (how ``trace-v2-last.msgpack`` was made: by
the last version-2 writer, just before version 3 added the checksum chain). A three-turn
tool conversation with token ids, through mitmdump, from the simulator playing vLLM; since
version 2 with ``max_turns=3``, so a fourth request is refused (its tool result a prompt
node, a ``stop`` record), sealed with the evaluator's rewards and metrics; and a response
hook that rewrites the second reply's text (its sampled and delivered nodes side by side, a
response ``rewrite`` record, the third turn chained on the delivered one); since version 4
with the upstream's weights version declared before the session (each turn stamped with it)
and again before the refused request (a second ``version`` record).
It also writes ``tests/data/schema-v<SCHEMA_VERSION>.json``, the record models' JSON schema
that tests/test_record_format.py holds the code to until the version moves on again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import sys
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the simulator and the helpers

from clients import KEY_ENV, REAL_KEY, session_clients  # noqa: E402
import json  # noqa: E402

from interceptor.trace import SCHEMA_VERSION, read_trace, record_schema  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from provider import ProviderSimulator  # noqa: E402
from test_trace_proxy import FakeVLLM, chat_loop, step_reply  # noqa: E402


HOOKS = '''
from interceptor.hooks import Response, intercept

@intercept
def deliver_other_text(response: Response):
    if response.message.text() == "Running step 1.":
        response.message.content = "Running step 1, as the evaluator put it."
        return response
    return None
'''


def main() -> int:
    named = sys.argv[1:3] if sys.argv[1:2] == ["--out"] else None
    schema = HERE / f"schema-v{SCHEMA_VERSION}.json"
    if not named and not schema.exists():
        schema.write_text(json.dumps(record_schema(), indent=1, sort_keys=True) + "\n")
        print(f"{schema}: written")
    out = HERE / (named[1] if named else f"trace-v{SCHEMA_VERSION}.msgpack")
    if out.exists():
        print(f"{out} exists; a golden file is never rewritten", file=sys.stderr)
        return 1
    hooks = Path(tempfile.mkdtemp()) / "golden_hooks.py"
    hooks.write_text(HOOKS)
    with ProviderSimulator() as sim, MitmProcess(
            options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV},
            env={KEY_ENV: REAL_KEY}) as proxy:
        assert proxy.api("PUT", "upstreams/default/version", {"version": 1})[0] == 200  # since version 4
        s = proxy.create_session(id="golden", collect_tokens=True, task={"name": "golden"},
                                 limits={"max_turns": 3}, hooks={"module": str(hooks)},
                                 upstream={"base_url": sim.url("/v1")})
        os.environ.update(s["env"])
        sim.default = FakeVLLM([step_reply(k, 3) for k in range(4)])
        oai, _ = session_clients(s)
        messages, _ = chat_loop(oai, 3, stream=True)
        assert proxy.api("PUT", "upstreams/default/version", {"version": "ckpt-2"})[0] == 200
        try:
            chat_loop(oai, 1, stream=True, messages=messages)
        except openai.BadRequestError as e:
            assert "rollout stopped: max_turns" in e.message
        else:
            raise AssertionError("the fourth request was not refused")
        proxy.api("DELETE", "sessions/golden", {"rewards": {"tests": {"score": 1.0, "weight": 0.5}},
                                                "metrics": {"steps": 3}})
        shutil.copyfile(s["trace_path"], out)
    trace = read_trace(out)
    print(f"{out}: {trace.num_turns} turns, {len(trace.nodes)} nodes, {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
