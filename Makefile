# One command each for a newcomer: `make run` (the whole experiment) and `make test` (the test suite).
# Both create the virtual environment and install what is missing first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
CORES ?= all
# Rules call `python -m shardfuse.<stage>`: put the venv first on PATH for every recipe.
export PATH := $(BIN):$(PATH)
STAMP := $(VENV)/.installed

# Tests that need a root daemon, a cluster, a server or a browser, and the benchmark smoke run; and the
# end-to-end experiments that take minutes (slow: the README's examples, every task through the
# workflow). `make test-all` (CI) runs them.
SERVICE_TESTS := slurm or server or browser or bench
SLOW_TESTS := slow

.PHONY: venv run test test-slow test-services test-all lint format ui clean
venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES)

# The fast tier, for every change: lint + every test that needs no root daemon, cluster, server or browser.
# Two pytest-xdist workers (a third on 2 cores was no faster and starves timing-sensitive tests), one
# test file per worker at a time (module fixtures are built once).
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(BIN)/python -m pytest -m "not ($(SERVICE_TESTS) or $(SLOW_TESTS))" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# The slow tier: whole experiments, no service; two workers, one test file each.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "$(SLOW_TESTS)" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# The service tier: SLURM clusters, the PostgreSQL-backed tracking server, the browser (.ci/run starts
# the single-node cluster first; the others are started by their tests), and the benchmark smoke run.
test-services: $(STAMP)
	$(BIN)/python -m pytest -m "$(SERVICE_TESTS)" --durations=15 $(PYTEST_ARGS)

# Everything (CI): the fast tier, the slow tier, then the service tier.
test-all: test test-slow test-services

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

ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf results logs benchmarks .snakemake mlflow.db mlruns mlartifacts
