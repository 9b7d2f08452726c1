# The two commands a newcomer runs: `make up` and `make test`. Both create .venv first.
# The interpreter .venv is made from: the distribution's CPython when it is 3.11 or later and
# can make a venv (Debian builds it with profile-guided and link-time optimization; a pyenv
# build has neither by default, and cpn's processes spend 20-25 % more CPU on it: the
# broker's proxy, bench/JOURNAL.md 2026-12-06, "the proxy on wrk"), else the first python3 on PATH.
# `make PYTHON=/path/to/python3` chooses; an existing .venv is kept (remove it to switch).
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NATIVE := $(VENV)/.native-stamp

.PHONY: up test test-fast lint fmt bench clean slurm prometheus chromium native sandbox systemd wheel-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The gateway's hot path (routing.native.MODULES) compiled by mypyc, beside its sources, with
# the venv's mypy and the types it checks against; rebuilt when a routing module changes. A C
# compiler and the Python headers are installed when missing (root and apt-get); without them
# the build says so and cpn runs those modules as Python (routing/native.py). CPN_COMPILE=0
# skips it. A module edited since the build runs from source until the next build.
$(NATIVE): $(STAMP) setup.py $(wildcard routing/*.py routing/*/*.py)
	@[ "$$CPN_COMPILE" = 0 ] || .ci/install-compiler $(BIN)/python \
		|| echo "make: no C compiler; the gateway's hot path runs as Python" >&2
	$(BIN)/python setup.py --quiet build_ext --inplace > $(VENV)/native-build.log
	touch $(NATIVE)

native: $(NATIVE)

up: $(NATIVE) sandbox
	$(BIN)/cpn up

# Tests run in TEST_WORKERS processes (pytest-xdist, --dist loadfile): a test file to a worker (a
# module's fixtures are made once), and the files that start a whole federation one unit, on one
# worker, first (tests/tiers.py: two federations side by side starve each other's leases on two
# cores), while the other worker takes the rest, longest first. Most e2e tests wait on
# processes more than they compute, so two workers halve the suite's time.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

test: lint native sandbox slurm prometheus chromium systemd
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

# The compiled wheel built, installed into a fresh venv outside the repository and run from
# there (tests/cpn/test_wheel.py; the pure wheel is in the suite): CI runs it after `make test`.
wheel-check: native
	CPN_TEST_COMPILED_WHEEL=1 $(BIN)/pytest -p no:cacheprovider tests/cpn/test_wheel.py

# The unit tier: every test not marked e2e (tests/tiers.py), no agent, broker or cpn process.
test-fast: native
	$(BIN)/pytest -m "not e2e" -n $(TEST_WORKERS) --dist loadfile

# bubblewrap and slirp4netns, which confine tenants' runs (docs/security.md): the Debian
# packages, installed when missing (root and apt-get). Without them agents refuse jobs.
sandbox:
	@.ci/install-sandbox || echo "make: bubblewrap could not be installed; agents will refuse jobs" >&2

# A real single-machine Slurm for tests/sites/executors/test_slurm.py and `cpn up --slurm`: the Debian
# packages, installed when missing (root and apt-get); nothing is started here.
slurm:
	@.ci/install-slurm || echo "make: Slurm could not be installed; the Slurm tests will skip" >&2

# Prometheus and promtool for tests/metering/test_prometheus.py (promtool checks every /metrics;
# a real Prometheus scrapes a test federation): the Debian package, installed when missing.
prometheus:
	@.ci/install-prometheus || echo "make: Prometheus could not be installed; its tests will skip" >&2

# systemd-analyze for tests/cpn/test_systemd_units.py (`systemd-analyze verify` on the units of
# configs/systemd/): the Debian package systemd, installed when missing; nothing is started.
systemd:
	@.ci/install-systemd || echo "make: systemd-analyze could not be installed; the unit tests will skip" >&2

# Headless Chromium and chromedriver for tests/broker/api/test_dashboard.py and
# bench/dashboard_paint.py: the Debian packages chromium and chromium-driver, when missing.
chromium:
	@.ci/install-chromium || echo "make: Chromium could not be installed; the dashboard test will skip" >&2

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(NATIVE)
	$(BIN)/python bench/registry_fanin.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
	rm -f routing/*.so routing/*/*.so routing/native-build.json
