"""Transport: the proxy's own connections to the upstream (HTTP and WebSocket), read to the
answer's end whatever the harness does, and handed back to mitmproxy through its public API."""
