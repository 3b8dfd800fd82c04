"""The session secret in a ``Proxy-Authorization`` value (``HTTPS_PROXY=http://rollout:<secret>@host:port``
arrives as Basic's password; a Bearer token is taken as it is).

One parser for every addon that reads the credential (Claim, the TLS guard, the open-proxy
guard, the egress check, the tool route), in a module that imports nothing of ours: a parser
kept in Claim made the egress check, which the session's network policy lives beside, import
Claim, which imports the session.
"""

from __future__ import annotations

import base64
import binascii


def proxy_auth_secret(value: str) -> str | None:
    """The secret ``value`` carries, or None (another scheme, bad base64, no password)."""
    scheme, _, rest = value.partition(" ")
    if scheme.lower() == "basic":
        try:
            user_pass = base64.b64decode(rest.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return user_pass.partition(":")[2] or None
    if scheme.lower() == "bearer":
        return rest.strip() or None
    return None
