"""Sizes in bytes as the ``intercept_*`` options write them: ``10``, ``10b``, ``512k``,
``64m``, ``1g``, ``2t`` (binary units, either case), 0 for no limit.

The grammar is mitmproxy's own for its size options (an integer as Python reads it, then at
most one unit letter), so every value the options accepted when mitmproxy parsed them still
means the same bytes; ours also takes a unit in capitals, and refuses a negative size, which
no limit can mean. Our own because mitmproxy's parser lives in a module its API reference
does not list (https://docs.mitmproxy.org/stable/api/events.html), free to change.
"""

from __future__ import annotations

from mitmproxy import exceptions

UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``text`` in bytes; ``ValueError`` when it is not a size."""
    number = text.strip()
    scale = UNITS.get(number[-1:].lower())
    if scale is not None:
        number = number[:-1]
    else:
        scale = 1
    value = int(number)  # a ValueError for anything else
    if value < 0:
        raise ValueError(f"a negative size: {text!r}")
    return value * scale


def size_option(name: str, value: str | None) -> int:
    """The size option ``name`` set to ``value``, in bytes (unset: 0, no limit); a bad value
    is an ``OptionsError`` naming the option and the value."""
    if value is None:
        return 0
    try:
        return parse_size(value)
    except ValueError as e:
        raise exceptions.OptionsError(f"{name}: not a size such as 64m, 512k or 1g: {value!r}") from e
