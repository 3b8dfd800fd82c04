"""The manual: the site builds with ``mkdocs build --strict`` (a broken link, a missing anchor
or a page left out of the navigation fails it), the reference pages say what the code says (a
default or a field can never be documented other than it is), and the README stays a first
page that points into the site rather than a second manual.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _generator():
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs() -> str:
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: mkdocs comes with the test extra (`make test-deps`)")
    return str(MKDOCS)


@pytest.mark.parametrize("page", sorted(_generator().PAGES))
def test_the_reference_page_is_what_the_code_says(page):
    expected = _generator().PAGES[page]()
    on_disk = (DOCS / "reference" / page).read_text()
    assert on_disk == expected, (
        f"docs/reference/{page} differs from the code: run `.venv/bin/python docs/gen/reference.py` "
        "and commit the page")


def test_the_options_reference_holds_every_option_with_its_real_default():
    """Every option the addons declare is a row, and a row's default is mitmproxy's own."""
    rows = {o["name"]: o for o in _generator().options()}
    page = (DOCS / "reference" / "options.md").read_text()
    listed = dict(re.findall(r"^\| `(intercept_\w+)` \| [^|]+ \| ([^|]+) \|", page, re.M))
    assert set(listed) == set(rows) and rows
    assert listed["intercept_trace_dir"].strip() == "`./traces`"
    assert listed["intercept_fsync"].strip() == f"`{rows['intercept_fsync']['default']}`"


def _build(tmp_path: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_mkdocs(), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(MKDOCS.parent), "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path):
    out = _build(tmp_path, ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()


def test_a_broken_link_or_a_page_out_of_the_nav_fails_the_build(tmp_path):
    """What the strict build is for: a copy of the site with one fault each fails it."""
    for fault in ("link", "orphan"):
        copy = tmp_path / fault
        copy.mkdir()
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
        if fault == "link":
            page = copy / "docs" / "getting-started.md"
            page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
        else:
            (copy / "docs" / "stray.md").write_text("# A page no one links to\n")
        out = _build(copy, copy)
        assert out.returncode != 0, f"a {fault} fault passed the strict build"
        assert ("no-such-page.md" if fault == "link" else "stray.md") in out.stdout + out.stderr


def test_the_readme_is_a_first_page_that_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in ("make run", "make test"):
        assert command in readme
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
    # Nothing that changes with a benchmark run: no per-run timings or ratios.
    assert not re.search(r"\d\s?(µs|ms)\b", readme), re.search(r".{40}\d\s?(µs|ms)\b.{20}", readme)
