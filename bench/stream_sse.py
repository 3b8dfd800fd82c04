"""The baseline for streamed answers: bare mitmdump, plus the one line any user streaming SSE
through mitmproxy needs (mitmproxy buffers whole bodies by default, so a bare proxy is not
a fair comparison for time to first event).

    mitmdump -s bench/stream_sse.py
"""

from mitmproxy import http


def responseheaders(flow: http.HTTPFlow) -> None:
    if flow.response and flow.response.headers.get("content-type", "").startswith("text/event-stream"):
        flow.response.stream = True
