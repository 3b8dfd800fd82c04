"""Test-only mitmproxy script: logs every collection the proxy's garbage collector makes.

Loaded after the entry script (``MitmProcess(extra_scripts=[GCWATCH])``), never by ``make
run``. Each collection is one ``GCWATCH gen=<generation> young=<objects in the young
generation when it began> collected=<objects freed>`` line, so a test can see how much one
collection had to walk and free (one that frees tens of thousands of objects at once stalls
every stream on the event loop for tens to hundreds of milliseconds).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)
_young = [0]


def _watch(phase: str, info: dict) -> None:
    if phase == "start":
        _young[0] = len(gc.get_objects(0))
    else:
        log.warning(f"GCWATCH gen={info['generation']} young={_young[0]} collected={info['collected']}")


class GcWatch:
    def running(self) -> None:
        if _watch not in gc.callbacks:
            gc.callbacks.append(_watch)


addons = [GcWatch()]
