"""Export formats other tools read: a document per trace, where ``export.py``'s formats are a
row per branch for trainers.

- ``atif``: an ATIF trajectory document (``interceptor.trace.atif``: a trajectory per branch,
  the others embedded in the one they part from).
- ``otel``: an OTLP JSON ``ExportTraceServiceRequest`` of OpenTelemetry GenAI spans
  (``interceptor.trace.otel``: a session span, a span per call; messages opt-in).

One document per line, flushed as it is written, so a reader following the file (or a
collector's file receiver) sees whole documents. Both need the ``export`` extra (the ``atif``
package and ``opentelemetry-proto``, each document is checked with them before it is
written); they are imported when a writer is made, never by the proxy.
"""

from __future__ import annotations

import json
from typing import IO, Any

from interceptor.trace.model import Trace

FORMATS = ("atif", "otel")


def _module(fmt: str):
    if fmt == "atif":
        from interceptor.trace import atif
        return atif
    from interceptor.trace import otel
    return otel


class Writer:
    """Documents of one format to one file; ``write`` per trace, ``close`` at the end.
    ``count`` is what was written: trajectories (atif) or spans (otel)."""

    def __init__(self, fmt: str, out: IO[str] | str, *, capture_content: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown interchange format {fmt!r}; one of {', '.join(FORMATS)}")
        if capture_content and fmt != "otel":
            raise ValueError("capturing message content is the otel format's opt-in; atif always holds it")
        self.format = fmt
        self.capture_content = capture_content
        self.count = 0
        self._module = _module(fmt)
        self._module.require()  # a missing package is said before anything is written
        self._own = isinstance(out, str)
        self._out = open(out, "w", encoding="utf-8") if isinstance(out, str) else out

    def write(self, trace: Trace, *, sampled_only: bool = False, min_reward: float | None = None) -> None:
        """``trace`` as one line. The filters are the row formats': ``min_reward`` skips the
        trace, ``sampled_only`` leaves out its branches with nothing sampled (atif only: otel
        has a span per call, not per branch, and refuses it)."""
        if min_reward is not None and (trace.reward is None or trace.reward < min_reward):
            return
        if self.format == "atif":
            doc = self._module.trajectory(trace, sampled_only=sampled_only)
            self.count += self._module.count(doc)
        else:
            if sampled_only:
                raise ValueError("--sampled-only selects branches; the otel format has a span per call")
            doc = self._module.request(trace, capture_content=self.capture_content)
            self.count += sum(len(ss["spans"]) for rs in doc["resourceSpans"] for ss in rs["scopeSpans"])
        self._out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._own:
            self._out.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_trace(trace: Trace, fmt: str, out: IO[str] | str, *, capture_content: bool = False,
                sampled_only: bool = False) -> int:
    """``trace`` as one ``atif`` or ``otel`` document to ``out`` (a path or an open text
    file); the trajectories or spans written."""
    if fmt not in FORMATS:
        raise ValueError(f"{fmt!r} is not a per-trace format ({', '.join(FORMATS)}); the row formats are "
                         "replay_trace.py export's")
    with Writer(fmt, out, capture_content=capture_content) as w:
        w.write(trace, sampled_only=sampled_only)
        return w.count
