"""The captures in tests/fixtures are ground truth: copied verbatim, never edited.

Every dialect and replay test reads them; a changed byte would make those tests check against
something no provider sent. The checksums were taken when the copy was made (see the README
there), so an edit fails here, and a file the tests expect cannot silently go missing.
"""

import hashlib
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_captures_are_unchanged_and_complete():
    listed = {}
    for line in (FIXTURES / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name.removeprefix("./")] = digest
    assert len(listed) >= 26
    for name, digest in listed.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name
    present = {str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*") if p.is_file()}
    assert present - {"README.md", "SHA256SUMS"} == set(listed)
