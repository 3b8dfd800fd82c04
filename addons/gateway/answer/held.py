"""A held answer: what the hold keeps of an upstream's answer while a session's response hooks
decide (``hold.py``), on the exchange as ``Exchange.hold``.

Every stage that carries an answer (the relay collects it, the pipeline runs its two passes,
the record commits what the hooks decided) names this one type, so it lives below them all
and imports nothing of theirs. Bytes beyond ``spill_bytes`` go to a temporary file, so a long
held stream costs the proxy's memory its bound, not its length.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from interceptor.trace.messages import Response

CHUNK = 1 << 16


@dataclass(eq=False)
class Held:
    """One held answer; ``Exchange.hold``."""

    spill_bytes: int = 1 << 20
    keepalive: float = 0.0
    phase: Literal["collect", "deliver"] = "collect"
    sampled: Response | None = None  # the assembled answer, its commit deferred to ``settle``
    sse: bool = False
    spill: tempfile.SpooledTemporaryFile | None = None
    size: int = 0
    body: bytes = b""  # a JSON answer as the harness would have received it
    head_sent: bool = False  # keepalive: the 200 and headers went out before the decision
    replaced: bool = False  # the harness got the proxy's answer, not the upstream's bytes

    def keep(self, data: bytes) -> None:
        if not data:
            return
        if self.spill is None:
            self.spill = tempfile.SpooledTemporaryFile(max_size=self.spill_bytes, prefix="interceptor-held-")
        self.spill.write(data)
        self.size += len(data)

    def spilled(self) -> bool:
        """Whether the held bytes went to disk: a spooled file rolls over once its size
        exceeds ``max_size`` (0: never), and every byte kept is counted in ``size``."""
        return self.spill is not None and 0 < self.spill_bytes < self.size

    def chunks(self) -> Iterator[bytes]:
        """The held bytes, a chunk at a time (the spill file is read back, then closed)."""
        if self.spill is None:
            return
        try:
            self.spill.seek(0)
            while data := self.spill.read(CHUNK):
                yield data
        finally:
            self.close()

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
