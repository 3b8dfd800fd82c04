# The two commands of the README: `make run` and `make test`. Everything else is theirs.
# A fresh machine needs only Python >= 3.12 somewhere (python3.13, python3.12, pyenv) and,
# for the harness tests, Node.js with npm.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=

# The first interpreter >= 3.12 found; mitmproxy 12 needs it.
PYTHON ?= $(shell for p in python3.13 python3.12 python3 \
	$$HOME/.pyenv/versions/3.1[3-9]*/bin/python3 $$HOME/.pyenv/versions/3.12*/bin/python3 \
	/usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)

.PHONY: run test test-lowest test-latest venv test-deps browser haproxy serve bench docs clean

# trace/_version.py: setup.cfg reads the version from it, and an editable install keeps the
# version it was installed with until it is reinstalled.
$(STAMP): setup.cfg pyproject.toml trace/_version.py
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; install python3.12 or set PYTHON=/path/to/python3.12" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $@

venv: $(STAMP)

# The test extras at the versions CI tests (tests/constraints.txt): `test` (pytest, the SDKs)
# and `harness` (mini-swe-agent, heavy: only the real-harness tests need it).
CONSTRAINTS := tests/constraints.txt

$(TEST_STAMP): $(STAMP) $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test,harness]'
	@touch $@

# The harness CLIs the end-to-end tests run (Claude Code, Codex), pinned by the lock file.
# Without npm, those tests skip and say why; everything else still runs.
HARNESSES := tests/harnesses
HARNESS_STAMP := $(HARNESSES)/node_modules/.installed

$(HARNESS_STAMP): $(HARNESSES)/package.json $(HARNESSES)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd $(HARNESSES) && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "warning: npm not found: the Claude Code and Codex tests will be skipped (install Node.js >= 18 with npm)" >&2; fi

# Headless Chromium for the HTML viewer's tests (tests/test_viewer.py): Debian's package,
# installed when this runs as root with apt-get; elsewhere those tests skip and say why.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
		|| echo "warning: could not install chromium: the viewer's browser tests will be skipped" >&2; \
	else echo "warning: chromium not found (not root, or no apt-get): the viewer's browser tests will be skipped; install Debian's chromium package to run them" >&2; fi

# HAProxy, the front of a multi-worker deployment (scripts/serve.py, tests/test_workers.py):
# the one on PATH, else Debian's package unpacked into .venv/haproxy by `apt-get download` and
# `dpkg -x` (as any user, no system change, removed with the venv) with the libraries a plain
# Debian lacks, run through the wrapper .venv/bin/haproxy. Without apt-get the worker tests
# skip and say why; with it, a failed download fails them (they never skip silently in CI).
HAPROXY_DIR := $(VENV)/haproxy
HAPROXY_STAMP := $(HAPROXY_DIR)/.installed
HAPROXY_DEBS := haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1

$(HAPROXY_STAMP): $(STAMP)
	@if command -v haproxy >/dev/null 2>&1; then mkdir -p $(HAPROXY_DIR) && touch $@; \
	elif command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then \
		rm -rf $(HAPROXY_DIR) && mkdir -p $(HAPROXY_DIR)/debs && cd $(HAPROXY_DIR)/debs && \
		{ apt-get download -q $(HAPROXY_DEBS) >/dev/null 2>&1 \
		  || { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download -q $(HAPROXY_DEBS) >/dev/null 2>&1; }; } \
		|| { echo "error: apt-get download $(HAPROXY_DEBS) failed: the worker tests need HAProxy" >&2; exit 1; }; \
		for d in *.deb; do dpkg -x "$$d" ../root; done && cd - >/dev/null && \
		printf '%s\n' '#!/bin/sh' 'root="$$(dirname "$$(readlink -f "$$0")")/../haproxy/root"' \
			'for d in "$$root"/usr/lib/*-linux-gnu; do LD_LIBRARY_PATH="$$d$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"; done' \
			'export LD_LIBRARY_PATH' 'exec "$$root/usr/sbin/haproxy" "$$@"' > $(VENV)/bin/haproxy && \
		chmod +x $(VENV)/bin/haproxy && $(VENV)/bin/haproxy -v | head -1 && touch $@; \
	else echo "warning: no haproxy and no apt-get: the multi-worker tests will be skipped (install HAProxy)" >&2; fi

haproxy: $(HAPROXY_STAMP)

test-deps: $(TEST_STAMP) $(HARNESS_STAMP) browser $(HAPROXY_STAMP)

# Set up and start the proxy on its embedded default (one session, printed at start).
run: venv
	$(VENV)/bin/mitmdump -s addons/interception.py --listen-host 127.0.0.1 $(ARGS)

# The proxy on every core: HAProxy on one address in front of one worker per core
# (scripts/serve.py; WORKERS=N for another count, ARGS for more of its options).
WORKERS ?=
serve: venv $(HAPROXY_STAMP)
	$(PY) scripts/serve.py $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

# The manual (mkdocs.yml, docs/) served at http://127.0.0.1:8000, rebuilt as pages change; the
# builder comes with the test extra. ARGS for more of `mkdocs serve`'s options (-a host:port).
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP) $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	@touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve $(ARGS)

# Set up and run the whole test suite, on two processes (pytest-xdist; a module's tests stay
# on one, so its module-scoped proxy starts once). ARGS="-n 0" runs it in this one.
XDIST := -n 2 --dist loadfile
test: test-deps
	$(VENV)/bin/pytest $(XDIST) $(ARGS)

# The whole suite again on the lowest mitmproxy setup.cfg accepts, in a venv of its own:
# tests/constraints.txt's pins with mitmproxy (and what it needs) moved to
# tests/constraints-lowest.txt's; the harness CLIs, browser and HAProxy are `make test`'s.
LOWEST := .venv-lowest
LOWEST_CONSTRAINTS := tests/constraints-lowest.txt
LOWEST_STAMP := $(LOWEST)/.installed

$(LOWEST_STAMP): setup.cfg pyproject.toml trace/_version.py $(CONSTRAINTS) $(LOWEST_CONSTRAINTS)
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found" >&2; exit 1; }
	@test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	grep -v -E '^(mitmproxy|aiohttp)==' $(CONSTRAINTS) > $(LOWEST)/constraints.txt
	$(LOWEST)/bin/python -m pip install -q -c $(LOWEST)/constraints.txt -c $(LOWEST_CONSTRAINTS) -e '.[test,harness]'
	@touch $@

test-lowest: $(LOWEST_STAMP) $(HARNESS_STAMP) browser $(HAPROXY_STAMP)
	$(LOWEST)/bin/python -c 'import mitmproxy.version as v; print("mitmproxy", v.VERSION)'
	INTERCEPT_HAPROXY="$$(test -x $(VENV)/bin/haproxy && echo $(CURDIR)/$(VENV)/bin/haproxy)" \
		$(LOWEST)/bin/pytest $(XDIST) $(ARGS)

# The suite against the newest releases: the SDKs, mitmproxy and mini-swe-agent unpinned (no
# constraints) in a venv of its own, and every npm harness at @latest installed beside it;
# tests/constraints.txt, package.json and the lock file stay as they are.
LATEST := .venv-latest
test-latest: $(HARNESS_STAMP)
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found" >&2; exit 1; }
	@command -v npm >/dev/null 2>&1 || { echo "error: test-latest needs Node.js with npm" >&2; exit 1; }
	@test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test,harness]'
	rm -rf $(LATEST)/harnesses && mkdir -p $(LATEST)/harnesses
	cd $(LATEST)/harnesses && echo '{"private": true}' > package.json && npm install --no-save --no-package-lock \
		--no-audit --no-fund --loglevel=error $$(node -p 'Object.keys(require("$(CURDIR)/$(HARNESSES)/package.json").dependencies).map(n => n + "@latest").join(" ")')
	cd $(LATEST)/harnesses && npm ls --depth=0
	INTERCEPT_HARNESS_BIN=$(CURDIR)/$(LATEST)/harnesses/node_modules/.bin $(LATEST)/bin/pytest $(ARGS)

# Issue 16's benchmark in one command: direct, bare mitmdump (plain and streaming), this proxy
# with 1 and 2 workers, LiteLLM's proxy and verifiers' interception server side by side
# (bench/compare.py; it installs the two peers into .venv-bench/ on first use). The report
# goes to bench-results/compare.md, the plot to docs/img/compare.png. ARGS=--quick: a smoke
# run of every path in a few minutes. The other bench/ scripts run with $(PY) bench/NAME.py.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[bench]'
	@touch $@

bench: test-deps $(BENCH_STAMP)
	$(PY) bench/compare.py $(ARGS)

clean:
	rm -rf $(VENV) $(LOWEST) $(LATEST) *.egg-info build
