"""The record format a trainer trusts: typed records (unknown fields refused), a version
that moves whenever the format does, and each version's file kept and still folded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
import pytest
from pydantic import ValidationError

from interceptor.trace import (
    MIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Recorder,
    Store,
    TraceFormatError,
    read_trace,
    record_schema,
)
from interceptor.trace import store as store_module
from interceptor.trace.verify import problems

DATA = Path(__file__).resolve().parent / "data"


def _format(schema):
    """The schema without its prose: a model's docstring (``description``) says what a field
    means to a reader, and rewording it changes nothing a reader of the records parses."""
    if isinstance(schema, dict):
        return {k: _format(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_format(v) for v in schema]
    return schema


def test_the_record_format_changes_only_with_a_schema_version_bump():
    snapshot = DATA / f"schema-v{SCHEMA_VERSION}.json"
    assert snapshot.exists(), f"no {snapshot.name}: run tests/data/make_golden.py for schema version {SCHEMA_VERSION}"
    assert _format(record_schema()) == _format(json.loads(snapshot.read_text())), (
        f"the record format changed under schema version {SCHEMA_VERSION}, which readers of that "
        "version would misread: raise SCHEMA_VERSION (trace/model.py) with its upgrade in "
        "trace/records.py and docs/record-format.md, then run tests/data/make_golden.py; "
        "or undo the change")


@pytest.mark.parametrize("version", range(MIN_SCHEMA_VERSION, SCHEMA_VERSION + 1))
def test_every_supported_version_has_a_file_the_proxy_wrote_and_it_folds(version):
    trace = read_trace(DATA / f"trace-v{version}.msgpack")
    assert trace.schema_version == version and trace.sealed and trace.num_turns == 3
    assert problems(trace) == []


def test_a_header_field_nobody_knows_is_refused_on_both_sides(tmp_path):
    store = Store()
    with pytest.raises(ValidationError, match="session"):
        Recorder(tmp_path / "a.msgpack", {"session": "typo-for-id"}, store=store)  # no aliases
    path = tmp_path / "b.msgpack"
    path.write_bytes(store_module.pack({"kind": "header", "schema_version": SCHEMA_VERSION, "id": "b",
                                        "started": 1.0}))
    with pytest.raises(TraceFormatError, match="not a header this reader knows.*started"):
        read_trace(path)


def test_a_value_msgpack_cannot_pack_is_an_error_not_a_string(tmp_path):
    """Under the test suite (STRICT_PACK, also set for every proxy it starts) a record holding,
    say, a set is refused where it is made, instead of reaching the file as "{1, 2}"."""
    assert store_module.STRICT_PACK
    store = Store()
    with pytest.raises(TypeError, match=store_module.UNPACKABLE):
        Recorder(tmp_path / "s.msgpack", {"info": {"ids": {1, 2}}}, store=store)
    store.flush(timeout=10)
    assert not (tmp_path / "s.msgpack").exists()


def readme_block(after: str) -> str:
    """The first Python block of the record format's page after the line that starts with ``after``."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "record-format.md").read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(after):], re.S)
    assert block, after
    return block.group(1)


# One byte over msgpack.Unpacker's default max_buffer_size (100 MiB), from which its default
# max_str_len comes too: the smallest record that proves a reader is not bound by them, and
# written and read in about a second (the writer's own bound, MAX_RECORD_BYTES, is 1 GiB).
BIG = (100 << 20) + 1


def test_a_record_over_the_unpackers_default_limits_reads_everywhere(tmp_path):
    """Whatever the writer writes, every reader reads: ``read_trace``, follow mode, and the
    record format page's reader in a few lines."""
    from interceptor.trace import Follower, ModelCall, ResponseError

    store = Store()
    path = tmp_path / "big.msgpack"
    r = Recorder(path, {"id": "big"}, store=store)
    r.record_call(ModelCall(id="big", status=502, error=ResponseError(type="upstream", message="x" * BIG)))
    r.seal("done")
    store.flush(timeout=60)
    assert path.stat().st_size > BIG
    trace = read_trace(path)
    assert trace.sealed and len(trace.calls[0].error.message) == BIG
    (item,) = Follower(tmp_path).poll()
    assert item.trace.sealed and len(item.trace.calls[0].error.message) == BIG
    scope = {"path": str(path)}
    exec(readme_block("A reader in a few lines"), scope)
    assert len(scope["calls"]) == 1 and len(scope["calls"][0]["error"]["message"]) == BIG
    del trace, item, scope


def test_the_writer_refuses_a_record_over_its_bound_and_the_trace_goes_on(tmp_path, monkeypatch):
    """The bound the readers are sized for (``MAX_RECORD_BYTES``): a bigger record fails where
    it is packed, never reaching a file no reader could read, and the trace goes on."""
    from interceptor.trace import records as records_module

    monkeypatch.setattr(store_module, "MAX_RECORD_BYTES", 4096)
    store = Store()
    r = Recorder(tmp_path / "b.msgpack", {"id": "b"}, store=store)
    with pytest.raises(ValueError, match="over the 4096 bytes"):
        store_module.pack({"kind": "metric", "name": "m", "value": "x" * 5000})
    r.record_metric("small", 1)
    r.seal("done")
    store.flush(timeout=10)
    trace = read_trace(tmp_path / "b.msgpack")
    assert trace.sealed and trace.metrics == {"small": 1}
    assert records_module.MAX_RECORD_BYTES == 1 << 30
