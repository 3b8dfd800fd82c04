"""The mitmproxy side: what only mitmproxy does, as ordinary addons in the script's list.

Options parsed once into typed specs (``settings``), the connection guards (open proxy, TLS
trust, egress, client timeouts), the control API, Claim (the dialect, the secret, the session),
the Gate that answers every fault in the dialect's shape, annotations and the status line, and
redaction last. These modules may import the gateway; the gateway never imports them.
"""
