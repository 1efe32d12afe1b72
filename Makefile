# One command each, on a fresh machine: `make run` serves the default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pip compiles every installed file to bytecode one at a time (83 of the runtime lock's 140 s here); compileall
# does the same on every core afterwards (49 s on two). Never skipped: where PYTHONDONTWRITEBYTECODE is set, a
# module without bytecode is compiled again by every process that imports it (torch + transformers: 11 s -> 22 s).
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile
COMPILE = $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true

.PHONY: run test install install-dev lint bench docs lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: $(PY) requirements.txt pyproject.toml src/inferd/grpc/proto/tei.proto src/inferd/grpc/proto/oip.proto src/inferd/grpc/build.py
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -e .
	$(PY) -m inferd.grpc.build
	$(COMPILE)
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	$(COMPILE)
	touch $@

install: $(VENV)/.runtime
install-dev: $(VENV)/.dev

# backend auto: torch at once, the fastest runtime the gate passes once judged (dev.yaml, the tests' overlay, stays torch).
run: install
	$(VENV)/bin/inferd serve --backend auto

# Two test processes (pytest-xdist): most of the suite waits on the servers it starts, so one process kept
# about 1.2 of the two cores busy (the fresh-clone CI run: 1,190 s of CPU in 983 s, installs included). Whole files
# to a worker (--dist loadfile: a module's shared server starts once), in the suite's own order
# (--no-loadscope-reorder: a package's shared servers start once per worker, not again each time a worker
# comes back to the package). TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= 2
# On workers, schemathesis reports its generated cases (tests/fuzz: one per API operation) as 2 items where one
# process runs 44: the fuzz suite runs in one process after the rest.
test: install-dev
	$(PY) -m pytest $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=tests/fuzz)
	$(if $(filter 1,$(TEST_WORKERS)),,$(PY) -m pytest tests/fuzz)

lint: install-dev
	$(VENV)/bin/ruff check src tests bench loadtest

bench: install-dev
	$(VENV)/bin/inferd bench

# The documentation site (docs/ + mkdocs.yml) into site/; strict: a broken link or anchor fails the build.
# NO_MKDOCS_2_WARNING quiets the banner mkdocs-material prints about MkDocs 2.0 on every build.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean --site-dir site

# Re-lock after editing requirements*.in (needs pip-tools in the venv).
lock: install-dev
	$(PIP) pip-tools
	$(VENV)/bin/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -o requirements.txt requirements.in
	$(VENV)/bin/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -o requirements-dev.txt requirements-dev.in

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build site src/*.egg-info
