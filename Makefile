# One command each for a newcomer: `make run` (the whole experiment) and `make test` (the test suite).
# Both create the virtual environment and install what is missing first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
CORES ?= all
# Rules call `python -m shardfuse.<stage>`: put the venv first on PATH for every recipe.
export PATH := $(BIN):$(PATH)
STAMP := $(VENV)/.installed

# Test tiers are folders of tests/ (README "Tests"). Budgets in seconds of wall time on a 2-core machine;
# each tier prints its time against its budget (scripts/test-tier.sh) and keeps a JUnit XML report in
# .test-reports/ for `python3 scripts/test-report.py`.
FAST_TESTS := tests/unit tests/contracts tests/stages tests/workflow
SLOW_TESTS := tests/slow
SERVICE_TESTS := tests/services
REPORTS := .test-reports
TIER := bash scripts/test-tier.sh
PYTEST := $(BIN)/python -m pytest --durations=15
# Python caches the compiled project (and pytest its rewritten tests) even where the environment says not
# to (PYTHONDONTWRITEBYTECODE, which some images set): every stage, agent and Snakemake process would
# otherwise compile the sources it imports again, ~0.5 s of CPU for the training's modules (an
# 8-run workflow: 64-71 s of CPU with the cache, 70-78 s without).
export PYTHONDONTWRITEBYTECODE :=
TEST_WORKERS ?= 2

.PHONY: venv run test test-fast test-slow test-services test-all lint format ui clean
venv: $(STAMP)

# INSTALLER=uv makes the same pinned environment with uv (CI: .ci/run installs it and points it at the
# disk's CPU build of torch): 9 s on 2 cores against pip's 80 s. pip otherwise.
INSTALLER ?= pip
UV ?= uv
$(STAMP): pyproject.toml constraints.txt
ifeq ($(INSTALLER),uv)
	$(UV) venv -q --seed --allow-existing --python $(PYTHON) $(VENV)
	$(UV) pip install -q --python $(BIN)/python -c constraints.txt -e '.[dev,hf]'
else
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,hf]'
endif
	touch $@

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES)

# The fast tier, for every change (budget 180 s, lint included): lint beside the unit, contract, stage and
# workflow tests (make -j2 -O: lint's output first, whole; a lint error still fails the tier). Two
# pytest-xdist workers (a third on 2 cores was no faster); a test module stays on one worker, so its
# fixtures are built once, the trainings shared across modules are built once per run, and the modules
# that train go first (tests/conftest.py, tests/support/schedule.py).
test: $(STAMP)
	@rm -f $(REPORTS)/fast.xml
	@$(TIER) fast 180 $(MAKE) --no-print-directory -j2 -O lint test-fast

# The fast tier without lint (narrow it with PYTEST_ARGS="-k merge").
test-fast: $(STAMP)
	$(PYTEST) $(FAST_TESTS) -n $(TEST_WORKERS) --dist loadfile --junitxml=$(REPORTS)/fast.xml $(PYTEST_ARGS)

# The slow tier (budget 15 min): the README's example experiments exactly as it shows them, every task
# through the workflow, the kill points of every model and strategy, the whole-workflow kill races.
test-slow: $(STAMP)
	@$(TIER) slow 900 $(PYTEST) $(SLOW_TESTS) -n $(TEST_WORKERS) --dist loadfile \
		--junitxml=$(REPORTS)/slow.xml $(PYTEST_ARGS)

# The service tier (budget 11 min): SLURM clusters, the PostgreSQL-backed tracking server, the browser
# (.ci/run starts the single-node cluster first; the others are started by their tests), the benchmark
# smoke run and the mergekit cross-check. Four workers, a module each: two run the single-node
# cluster's two modules, whose tests spend most of their time waiting on SLURM's scheduling and status
# polls; the third the two-node cluster (a cluster of its own); the fourth the servers, the browser and
# the benchmarks (on a 2-core machine: 474 s, against 641 s with three workers and 828 s with two).
SERVICE_WORKERS ?= 4
test-services: $(STAMP)
	@$(TIER) services 660 $(PYTEST) $(SERVICE_TESTS) -n $(SERVICE_WORKERS) --dist loadfile \
		--junitxml=$(REPORTS)/services.xml $(PYTEST_ARGS)

# Everything (CI): the fast tier, then the slow tier and the service tier side by side (the service
# tier mostly waits on SLURM's queue and status polls, servers and a browser, so the slow tier's
# trainings take its idle cores; each tier's output is printed whole when it ends, make's -O); then
# the table of tier times, the whole run's wall time included. BEFORE_REST runs between the fast tier
# and the others (.ci/run: it waits there for the installs only those need, made beside the fast tier).
BEFORE_REST ?= true
test-all:
	@rm -rf $(REPORTS)
	@$(MAKE) --no-print-directory test; fast=$$?; \
		$(BEFORE_REST) && $(MAKE) --no-print-directory -k -j2 -O test-slow test-services; rest=$$?; \
		python3 scripts/test-report.py; [ $$fast -eq 0 ] && [ $$rest -eq 0 ]

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint
	@if command -v shellcheck >/dev/null; then shellcheck scripts/*.sh .ci/run; \
	else echo "shellcheck not installed: skipping the shell-script lint (CI installs it)"; fi

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/snakefmt Snakefile workflow/rules

# The MLflow UI of the local store; first the URL of an experiment's leaderboard (shardfuse.leaderboard).
UI_PORT ?= 5000
UI_EXPERIMENT ?= shardfuse
ui: $(STAMP)
	@printf 'leaderboard: %s\n' "$$($(BIN)/python -m shardfuse.leaderboard --tracking-uri sqlite:///mlflow.db \
		--experiment '$(UI_EXPERIMENT)' --ui http://127.0.0.1:$(UI_PORT))" || true
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port $(UI_PORT)

clean:
	rm -rf results logs benchmarks .snakemake mlflow.db mlruns mlartifacts $(REPORTS)
