# Fault-tolerant multi-node PyTorch training in containers.  `make help` lists everything.
#
# One rule for settings: VAR=value on make's command line. NODES, NPROC, GPUS, RUN, NODE and
# OBJECT_STORE are the job's own; any trainer flag --foo-bar is FOO_BAR=value (make up NODES=2 LR=0.05
# WARMUP_EPOCHS=2) and reaches the trainer as TRAIN_FOO_BAR. scripts/job.py reads them
# (and owns their defaults), for the container targets and the local runs alike.

SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
# The job targets hand every command-line variable (NAME=value) to scripts/job.py; other targets
# (image, chaos) take only their own, so `make chaos FAULTS=3` builds the image without FAULTS.
JOB   := $(PY) -m scripts.job

.DEFAULT_GOAL := help
.PHONY: help venv lock run run-ddp plot tensorboard test bench gpu-report engine image up down logs ps kill restart chaos slurm slurm-job slurm-stop clean \
        check-up check-sbatch

help: ## Show targets and settings
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo
	@python3 -m scripts.job help
	@echo "  TESTS    make test: a pytest marker expression, e.g. TESTS=unit (default: every tier)"
	@echo "  FAULTS   make chaos: faults to inject (SEED: the trainer's and the schedule's seed; CONFIG: quick or cifar-size;"
	@echo "           EPOCHS: the job's length; ONLY: fault kinds to draw from, e.g. ONLY=kill_rank0,partition; BASELINE=0: no fault-free run;"
	@echo "           FT: the modes to compare, default elastic,torchft,inplace; SPARES: warm spares, with FT=inplace;"
	@echo "           EVERY: a fault every EVERY seconds instead, every set-up side by side, e.g. EVERY=60)"
	@echo "  UPGRADE  make lock UPGRADE=1: the newest allowed versions instead of keeping the pins"
	@echo "  PORT, BIND   make tensorboard: where it serves (default 6006 on 127.0.0.1)"

# ------------------------------------------------------------------ local training

# .venv is installed from the lock alone: requirements.txt pins every package (the image's
# included) with hashes, so the .in files only matter to `make lock`. Disk is what runs out on a
# small machine, so pip keeps no cache (a second copy of torch's 3 GB of wheels), and when
# scripts/docker-engine.sh has filled the wheelhouse for this lock and this Python, the packages the
# image shares with .venv (all of its lock) install from there, not from a third download.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check --no-cache-dir --require-hashes
$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	if bash scripts/docker-engine.sh wheelhouse-ready $(PY); then \
	  $(PIP_INSTALL) --no-index --find-links .cache/wheelhouse --no-deps -r requirements-image.txt; fi
	$(PIP_INSTALL) -r requirements.txt
	touch $@

# The digits as a tensor file, prepared once here rather than at every start: a trainer that finds
# it skips importing scikit-learn (half of a fresh clone's start on the 2-core machine, docs/training.md).
data/digits.pt: | $(VENV)/.installed
	$(PY) -m scripts.prepare --data-dir data --dataset digits

venv: $(VENV)/.installed data/digits.pt ## Create .venv with torch, torchvision and the test tools; prepare data/digits.pt

# Locks for the image's platform (bookworm: Python 3.11, glibc 2.36, x86_64) whatever the host,
# wheels only (the image build is offline). uv takes its index from its own settings
# (default index, or UV_DEFAULT_INDEX), never from the lock, and the lock must name none.
LOCK_FLAGS := --quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_36 \
              --only-binary :all: --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)

lock: venv ## Re-resolve requirements*.in into the hash-pinned locks requirements*.txt [UPGRADE=1]
	$(VENV)/bin/uv pip compile $(LOCK_FLAGS) -o requirements-image.txt requirements-image.in
	$(VENV)/bin/uv pip compile $(LOCK_FLAGS) -o requirements.txt requirements.in
	@! grep -nE -- '--(extra-)?index-url|--find-links|://' requirements-image.txt requirements.txt \
	  || { echo "error: a lock names an index or a URL; remove it from the uv settings" >&2; exit 1; }

run: venv ## Train as one plain process (CIFAR-10 when prepared under data/, else digits)
	$(JOB) run $(MAKEOVERRIDES)

run-ddp: venv ## Train under torchrun on this host with NPROC processes
	$(JOB) run-ddp $(MAKEOVERRIDES)

plot: venv ## Draw runs/RUN/curves.png from its metrics.jsonl
	$(PY) -m app.plot runs/$(or $(RUN),default)

# Only this machine can reach it by default; BIND=0.0.0.0 shares it with the network.
tensorboard: venv ## Serve the TensorBoard curves of runs/RUN on http://127.0.0.1:6006 [PORT= BIND=]
	@[ -d "runs/$(or $(RUN),default)" ] || { echo "error: no run directory runs/$(or $(RUN),default) (make tensorboard RUN=name)" >&2; exit 2; }
	$(VENV)/bin/tensorboard --logdir runs/$(or $(RUN),default) --host $(or $(BIND),127.0.0.1) --port $(or $(PORT),6006)

# ------------------------------------------------------------------ checks

# Only the docker tier needs an engine, the base image and the wheelhouse; without them it skips.
NEEDS_ENGINE := $(if $(TESTS),$(findstring docker,$(TESTS)),yes)

# Two passes (tests/run.py): the tests that bound no time one per core, then the serial ones alone.
test: venv ## Run the test suite: unit, multiprocess, docker and slurm tiers (they start an engine, a Slurm cluster)
	$(if $(NEEDS_ENGINE),-bash scripts/docker-engine.sh ensure)
	$(PY) -m tests.run $(if $(TESTS),-m "$(TESTS)")

bench: venv ## Trainer vs bare DDP loop throughput and snapshot stall -> bench/results.json
	$(PY) -m bench.overhead

# On a lent GPU machine: its own python3 and torch, no virtualenv (it reaches no package index).
gpu-report: ## Every GPU figure in at most 10 minutes -> bench/gpu_report.json and .md (python3 and torch of the host)
	python3 -m bench.gpu_report

# ------------------------------------------------------------------ containers

engine: ## Install and start a Docker engine with compose v2 and buildx (Debian hosts)
	bash scripts/docker-engine.sh ensure

# A target with slow prerequisites (an engine or a cluster to install, an image to build) checks
# its settings first, in scripts/job.py: `make up NODES=0` fails in a second, before any of them.
check-up check-sbatch: check-%: $(VENV)/.installed
	@$(JOB) check $* $(MAKEOVERRIDES)

image: engine venv ## Build the trainer image (offline, from the host wheelhouse)
	$(JOB) build

up: check-up image ## Start one DDP job over NODES node containers and wait until it trains: make up NODES=2 [OBJECT_STORE=1 EPOCHS=5 ...]
	$(JOB) up $(MAKEOVERRIDES)

down: venv ## Stop the job's containers, the object store's too (the run directory and the store's volume stay)
	$(JOB) down $(MAKEOVERRIDES)

logs: venv ## Follow the nodes' output (spares too) until they have all exited
	$(JOB) logs $(MAKEOVERRIDES)

ps: venv ## List the job's containers
	$(JOB) ps $(MAKEOVERRIDES)

kill: venv ## Kill node NODE (docker kill): the others go on without it
	$(JOB) kill $(MAKEOVERRIDES)

restart: venv ## Start node NODE again (docker start): it rejoins the job on free GPUs
	$(JOB) restart $(MAKEOVERRIDES)

chaos: venv image ## Inject FAULTS random faults into a container job -> chaos/report.json
	$(PY) -m scripts.chaos $(if $(NODES),--nodes $(NODES)) $(if $(FAULTS),--faults $(FAULTS)) $(if $(SEED),--seed $(SEED)) \
	  $(if $(CONFIG),--config $(CONFIG)) $(if $(EPOCHS),--epochs $(EPOCHS)) $(if $(ONLY),--only $(ONLY)) \
	  $(if $(FT),--ft $(FT)) $(if $(filter 0,$(BASELINE)),--no-baseline) $(if $(SPARES),--spares $(SPARES)) \
	  $(if $(EVERY),--every $(EVERY))

# ------------------------------------------------------------------ Slurm

slurm: ## Install and start a Slurm cluster on this host: slurmctld + two slurmd, nodes n1 n2 (root)
	bash scripts/slurm-cluster.sh ensure

slurm-job: check-sbatch slurm ## sbatch scripts/train.sbatch on NODES nodes x NPROC processes [EPOCHS= ...]
	$(JOB) sbatch $(MAKEOVERRIDES)

slurm-stop: ## Stop the Slurm cluster (cancels its jobs; no Slurm or munge daemon stays)
	bash scripts/slurm-cluster.sh stop

# ------------------------------------------------------------------

clean: $(VENV)/.installed ## Remove the containers, generated data and caches (runs/ is kept)
	-$(JOB) down
	rm -rf .pytest_cache bench/results.json chaos data .cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
