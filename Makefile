# The README's two commands are `make run` and `make test`; both install what they need first.
PY := .venv/bin/python
STAMP := .venv/.installed-stamp

.PHONY: install run test bench demo clean

install: $(STAMP)

$(STAMP): pyproject.toml infra/install.sh
	bash infra/install.sh
	touch $(STAMP)

run: install
	.venv/bin/harvest up

demo: install
	bash infra/demo.sh

# Two test processes (pytest-xdist), each taking whole modules (`--dist loadfile`: a module's
# stack stays in one process; a RUN_TOGETHER group of modules is one unit), the slowest first (tests/conftest.py, SLOWEST_MODULES;
# `--no-loadscope-reorder` keeps that order). Each has its own session (its own Prefect server,
# its own HARVEST_HOME). The suite is CPU-bound on a 2-core machine: two processes keep both
# cores busy (~14 minutes); three took longer (the cores 99 % busy). TEST_WORKERS=0 runs one.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf .venv .harvest
