# Fault-tolerant multi-node PyTorch training in containers.  `make help` lists everything.
#
# Variables (make VAR=value ...):
#   NODES    node containers for `make up` (one container = one torchrun node)       [2]
#   NPROC    training processes per node (containers and `make run-ddp`)           [1]
#   RUN      run name: snapshots and metrics.jsonl live in runs/$(RUN)              [default]
#   DATASET  auto | cifar10 | cifar100 | digits | synthetic                          [auto]
#   EPOCHS, MODEL, BATCH_SIZE, LR   passed to the trainer when set
#   NODE     which node `make kill` / `make restart` acts on (1..NODES)
#   FAULTS, SEED   for `make chaos`: number of faults and the random seed           [20, 0]
#   TESTS    pytest marker expression for `make test`, e.g. TESTS="unit"          [all tiers]
#   PORT, BIND   where `make tensorboard` serves runs/$(RUN)               [6006, 127.0.0.1]

SHELL   := /bin/bash
NODES   ?= 2
NPROC   ?= 1
RUN     ?= default
DATASET ?= auto
FAULTS  ?= 20
SEED    ?= 0
TESTS   ?=
PORT    ?= 6006
BIND    ?= 127.0.0.1

VENV    := .venv
PY      := $(VENV)/bin/python
RUN_DIR := runs/$(RUN)
# Trainer settings that were given on the command line travel as TRAIN_* variables.
TRAIN_ENV := TRAIN_DATASET=$(DATASET) $(if $(EPOCHS),TRAIN_EPOCHS=$(EPOCHS)) $(if $(MODEL),TRAIN_MODEL=$(MODEL)) \
             $(if $(BATCH_SIZE),TRAIN_BATCH_SIZE=$(BATCH_SIZE)) $(if $(LR),TRAIN_LR=$(LR))
# Containers: one compose project; GPU hosts use compose.yaml alone, others add the CPU override.
export COMPOSE_PROJECT_NAME := ftt
export COMPOSE_FILE := $(if $(shell nvidia-smi -L 2>/dev/null),compose.yaml,compose.yaml:compose.cpu.yaml)
# Containers run as the invoking user, so runs/ stays theirs; as root, as uid 1000 (never root).
OWNER   := $(if $(filter 0,$(shell id -u)),1000:1000,$(shell id -u):$(shell id -g))
COMPOSE := FTT_NODES=$(NODES) FTT_RUN_NAME=$(RUN) FTT_UID=$(word 1,$(subst :, ,$(OWNER))) \
           FTT_GID=$(word 2,$(subst :, ,$(OWNER))) NPROC_PER_NODE=$(NPROC) $(TRAIN_ENV) docker compose

.DEFAULT_GOAL := help
.PHONY: help venv run run-ddp plot tensorboard test bench engine image up down logs ps kill restart chaos clean

help: ## Show targets and variables
	@sed -n '3,12p' $(MAKEFILE_LIST) | sed 's/^# \{0,1\}//'
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# ------------------------------------------------------------------ local training

$(VENV)/.installed: requirements.txt requirements-image.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(VENV)/.installed ## Create .venv with torch, torchvision and the test tools

run: venv ## Train as one plain process (CIFAR-10 when prepared under data/, else digits)
	$(TRAIN_ENV) $(PY) -m app.train --run-dir $(RUN_DIR)

run-ddp: venv ## Train under torchrun on this host with NPROC processes
	$(TRAIN_ENV) $(PY) -m torch.distributed.run --standalone --nproc-per-node=$(NPROC) -m app.train --run-dir $(RUN_DIR)

plot: venv ## Draw runs/$(RUN)/curves.png from its metrics.jsonl
	$(PY) -m app.plot $(RUN_DIR)

# Only this machine can reach it by default; BIND=0.0.0.0 shares it with the network.
tensorboard: venv ## Serve runs/$(RUN)'s TensorBoard curves on http://$(BIND):$(PORT)
	@[ -d "$(RUN_DIR)" ] || { echo "error: no run directory $(RUN_DIR) (make tensorboard RUN=name)" >&2; exit 2; }
	$(VENV)/bin/tensorboard --logdir $(RUN_DIR) --host $(BIND) --port $(PORT)

# ------------------------------------------------------------------ checks

# Only the docker tier needs an engine, the base image and the wheelhouse; without them it skips.
NEEDS_ENGINE := $(if $(TESTS),$(findstring docker,$(TESTS)),yes)

test: venv ## Run the test suite: unit, multi-process and docker tiers (the docker tier starts an engine)
	$(if $(NEEDS_ENGINE),-bash scripts/docker-engine.sh ensure)
	$(PY) -m pytest $(if $(TESTS),-m "$(TESTS)")

bench: venv ## Trainer vs bare DDP loop throughput and snapshot stall -> bench/results.json
	$(PY) -m bench.overhead

# ------------------------------------------------------------------ containers

engine: ## Install and start a Docker engine with compose v2 and buildx (Debian hosts)
	bash scripts/docker-engine.sh ensure

image: engine ## Build the trainer image (offline from the host wheelhouse on CPU hosts)
	$(COMPOSE) build trainer

up: image ## Start one DDP job over NODES node containers: make up NODES=2 [DATASET= EPOCHS= MODEL=]
	@[[ "$(NODES)" =~ ^[1-9][0-9]*$$ ]] || { echo "error: NODES must be a positive integer, got '$(NODES)'" >&2; exit 2; }
	python3 -m scripts.prepare --run-dir $(RUN_DIR) --owner $(OWNER)
	$(COMPOSE) up --detach --scale trainer=$(NODES) store trainer
	@echo "job started: $(NODES) nodes x $(NPROC) processes, run directory $(RUN_DIR)/"
	@echo "  follow it: make logs    metrics: $(RUN_DIR)/metrics.jsonl    stop it: make down"

down: ## Stop the job's containers (the run directory stays)
	$(COMPOSE) down --remove-orphans

logs: ## Follow the nodes' output
	$(COMPOSE) logs --follow --tail=50

ps: ## List the job's containers
	$(COMPOSE) ps --all

kill: ## Kill node NODE (docker kill): the others go on without it
	@[ -n "$(NODE)" ] || { echo "error: say which node: make kill NODE=1" >&2; exit 2; }
	docker kill $(COMPOSE_PROJECT_NAME)-trainer-$(NODE)

restart: ## Start node NODE again (docker start): it rejoins the job
	@[ -n "$(NODE)" ] || { echo "error: say which node: make restart NODE=1" >&2; exit 2; }
	docker start $(COMPOSE_PROJECT_NAME)-trainer-$(NODE)

chaos: venv image ## Inject FAULTS random faults into a container job -> chaos/report.json
	$(PY) -m scripts.chaos --nodes $(NODES) --faults $(FAULTS) --seed $(SEED)

clean: ## Remove the containers, generated data and caches (runs/ is kept)
	-$(COMPOSE) down --remove-orphans --volumes
	rm -rf .pytest_cache bench/results.json chaos data .cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
