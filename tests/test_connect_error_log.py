"""A connection mitmproxy cannot make is logged with its host and port, at the default verbosity.

mitmproxy's own line says only "error establishing server connection: [Errno -2] Name or
service not known": with TLS passed through untouched (any host not claimed) there is no
flow line either, so an operator could not tell which host a harness failed to reach.
"""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from clients import DEAD_PORT
from waiting import wait_until


def wait_for_line(proc, pattern: str, timeout: float = 20.0) -> str:
    """The first log line matching ``pattern``, as soon as mitmdump has written it."""
    return wait_until(lambda: re.search(pattern, proc.log()), timeout,
                      lambda: f"a line matching {pattern!r} in:\n{proc.log()}").group(0)


@pytest.mark.parametrize(("host", "port", "why"), [
    ("nohost.invalid", 443, "Name or service not known|nodename nor servname|Temporary failure"),
    ("localhost", DEAD_PORT, "refused|Connect call failed"),
], ids=["unresolvable", "refused"])  # not the port: every xdist worker must collect the same ids
def test_a_failed_passthrough_names_its_host_and_port(start_proxy, host, port, why):
    proc = start_proxy()  # termlog_verbosity info: mitmdump's default
    with httpx.Client(proxy=proc.url, verify=ssl.create_default_context(cafile=str(proc.ca_bundle)),
                      timeout=20) as c:
        with pytest.raises(httpx.HTTPError):
            c.get(f"https://{host}:{port}/simple/")
    line = wait_for_line(proc, rf"interceptor: cannot connect to {re.escape(host)}:{port}\b.*")
    assert re.search(why, line), line
