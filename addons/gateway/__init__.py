"""The gateway: one model exchange from claim to record.

The retry decision, policy, rewrite, the upstream I/O, the answer's pipeline and the record
that ends an exchange. It sits below the mitmproxy side (``interceptor.addons.mitm``) and never
imports it: what it needs of the options arrives as plain values, so each stage can be read
and tested alone.
"""
