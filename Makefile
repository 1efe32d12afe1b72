# One command each, on a fresh machine: `make run` serves the default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test install install-dev lint bench lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: $(PY) requirements.txt pyproject.toml
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

install: $(VENV)/.runtime
install-dev: $(VENV)/.dev

run: install
	$(VENV)/bin/inferd serve

test: install-dev
	$(PY) -m pytest

lint: install-dev
	$(VENV)/bin/ruff check src tests bench loadtest

bench: install-dev
	$(VENV)/bin/inferd bench

# Re-lock after editing requirements*.in (needs pip-tools in the venv).
lock: install-dev
	$(PIP) pip-tools
	$(VENV)/bin/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -o requirements.txt requirements.in
	$(VENV)/bin/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -o requirements-dev.txt requirements-dev.in

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
