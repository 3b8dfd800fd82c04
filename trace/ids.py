"""Ids for the records a proxy writes per request (calls, rewrites): 16 hex digits, random.

``uuid.uuid4().hex[:16]`` asks the kernel for 16 bytes (a ``getrandom`` system call) and
builds a UUID object for each, twice per model request, on the event loop. These ids name records inside one trace; they are not
secrets and need no cryptographic randomness, only not to repeat: 64 bits from a generator
of this module's own, seeded from the system's randomness and again in a forked child (a
hook that seeds ``random``'s shared generator cannot make them repeat). Session ids and
anything that must not be guessed stay with ``secrets``/``uuid``.
"""

from __future__ import annotations

import os
import random

_random = random.Random()
os.register_at_fork(after_in_child=_random.seed)


def new_id() -> str:
    """16 hex digits: a call's or a rewrite's id."""
    return f"{_random.getrandbits(64):016x}"
