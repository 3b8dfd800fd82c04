"""Which parameters a model family accepts: a table of data (``models.json``), not name checks.

The dialects reconcile a rewritten request against the row of its model: does it take
sampling parameters (all, one of temperature/top_p, none), which thinking modes, is it an
OpenAI reasoning model, how many output tokens may one answer ask for. Each row names its source and when it was checked, so a row that goes
stale can be found and fixed without reading code. A model no row matches gets ``UNKNOWN``:
only the rules that hold for every model of its provider apply, and the proxy's provider
feedback (a 400 naming a parameter the proxy set) learns the rest at run time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path
from typing import Literal

TABLE = Path(__file__).with_name("models.json")

SamplingRule = Literal["any", "exclusive", "none"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """One row of the table. ``None`` means "not known": the general rules decide."""

    provider: str | None = None
    sampling: SamplingRule | None = None  # "exclusive": temperature and top_p not both
    thinking: frozenset[str] | None = None  # Anthropic thinking types the model takes
    reasoning: bool | None = None  # OpenAI reasoning model
    # Gemini: thinkingBudget's range (-1, dynamic, always taken), whether 0 (no thinking) is,
    # and the thinkingLevel values (empty: refused, as before Gemini 3).
    budget: tuple[int, int] | None = None
    budget_off: bool | None = None
    levels: tuple[str, ...] | None = None
    # The most output tokens one answer may ask for (Anthropic ``max_tokens``), where the
    # model's cap is below its provider's general one; a request above it is refused with 400.
    max_output: int | None = None
    source: str | None = None

    def takes_thinking(self, kind: str) -> bool:
        return self.thinking is None or kind in self.thinking


UNKNOWN = Capabilities()


@lru_cache(maxsize=1)
def _rows() -> tuple[tuple[str, tuple[str, ...], Capabilities], ...]:
    data = json.loads(TABLE.read_text())
    rows = []
    for row in data["families"]:
        thinking = row.get("thinking")
        caps = Capabilities(
            provider=row["provider"],
            sampling=row.get("sampling"),
            thinking=frozenset(thinking) if thinking is not None else None,
            reasoning=row.get("reasoning"),
            budget=tuple(row["budget"]) if row.get("budget") is not None else None,
            budget_off=row.get("budget_off"),
            levels=tuple(row["levels"]) if row.get("levels") is not None else None,
            max_output=row.get("max_output"),
            source=row["source"],
        )
        rows.append((row["provider"], tuple(p.lower() for p in row["match"]), caps))
    return tuple(rows)


@lru_cache(maxsize=4096)
def capabilities(provider: str, model: str | None) -> Capabilities:
    """The first row of ``provider`` whose pattern matches ``model``, else ``UNKNOWN``."""
    if not model:
        return UNKNOWN
    name = model.rsplit("/", 1)[-1].lower()
    for row_provider, patterns, caps in _rows():
        if row_provider == provider and any(fnmatchcase(name, p) for p in patterns):
            return caps
    return UNKNOWN
