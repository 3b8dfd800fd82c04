"""Size options (``intercept_max_body``, ``intercept_max_answer``, ``intercept_max_event``,
``intercept_state_max_bytes``, ``intercept_rewrite_keep_bytes``) are read by our own parser,
``interceptor.addons.gateway.sizes``, not by ``mitmproxy.utils.human`` (not in mitmproxy's API
reference). It accepts every value mitmproxy's parser accepted and means the same bytes by
it, so no configuration changes meaning; beyond that, a unit in capitals (``64M``) is
accepted and a negative size, which meant nothing sensible, is refused.

Checked three ways: a table of inputs, a property over generated ones (against mitmproxy's
parser while it still ships, the oracle of "what the options accepted before"), and a real
mitmdump refusing a bad size in one line naming the option."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import exceptions

from interceptor.addons.gateway.sizes import parse_size, size_option
from mitm import MitmProcess

K, M, G, T = 1 << 10, 1 << 20, 1 << 30, 1 << 40

TABLE = {
    "0": 0, "10": 10, "10b": 10, "10k": 10 * K, "10m": 10 * M, "1g": G, "2t": 2 * T,
    "10K": 10 * K, "64M": 64 * M, "1G": G, "7B": 7, "512k": 512 * K, "0m": 0,
    " 16m ": 16 * M, "16 m": 16 * M, "+5k": 5 * K, "1_000": 1000, "-0": 0,
}
BAD = ["", " ", "k", "m5", "1.5m", "1e6", "10kb", "10 kb", "10x", "ten", "0x10", "--1", "-1", "-5k", "1 0",
       "10kk", "\n"]


@pytest.mark.parametrize("text", list(TABLE))
def test_the_table_of_sizes(text):
    assert parse_size(text) == TABLE[text]


@pytest.mark.parametrize("text", BAD)
def test_not_a_size_is_a_value_error(text):
    with pytest.raises(ValueError):
        parse_size(text)


@given(st.integers(0, 1 << 40), st.sampled_from(["", "b", "k", "m", "g", "t"]), st.booleans())
def test_a_number_and_its_unit_in_either_case(n, unit, upper):
    scale = {"": 1, "b": 1, "k": K, "m": M, "g": G, "t": T}[unit]
    assert parse_size(f"{n}{unit.upper() if upper else unit}") == n * scale


@settings(max_examples=500)
@given(st.text(alphabet="0123456789bkmgtBKMGTx+-_. \t", max_size=8))
def test_what_mitmproxys_parser_accepted_means_the_same(text):
    human = pytest.importorskip("mitmproxy.utils.human")
    try:
        theirs = human.parse_size.__wrapped__(text)  # past its cache: each example runs it
    except ValueError:
        theirs = None
    try:
        ours = parse_size(text)
    except ValueError:
        ours = None
    if theirs is not None and theirs >= 0:
        assert ours == theirs, text
    if ours is not None and theirs is None:  # ours takes more only: a capital unit, spaces around
        assert human.parse_size.__wrapped__(text.strip().lower()) == ours, text
    if theirs is not None and theirs < 0:
        assert ours is None, text


def test_a_bad_size_option_names_the_option_and_the_value():
    with pytest.raises(exceptions.OptionsError) as e:
        size_option("intercept_max_body", "1.5m")
    assert str(e.value) == "intercept_max_body: not a size such as 64m, 512k or 1g: '1.5m'"
    with pytest.raises(exceptions.OptionsError, match="intercept_max_event: not a size"):
        size_option("intercept_max_event", "-1")
    assert size_option("intercept_max_event", "16M") == 16 * M and size_option("intercept_max_body", None) == 0


@pytest.mark.parametrize("option", ["intercept_max_body", "intercept_max_answer"])
def test_a_bad_size_stops_mitmdump_in_one_line_naming_it(tmp_path, option):
    proc = MitmProcess(options={option: "12x"}, workdir=tmp_path)
    proc.start(timeout=20, expect_failure=True)
    try:
        code = proc.wait(20)
        out = proc.log()
    finally:
        proc.cleanup()
    assert code == 1, out
    lines = [line for line in out.splitlines() if "interceptor: cannot start" in line]
    assert len(lines) == 1 and f"{option}: not a size such as 64m, 512k or 1g: '12x'" in lines[0], out
    assert "Traceback" not in out and "listening" not in out, out
