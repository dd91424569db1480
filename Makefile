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
# stack stays in one process): much of the suite waits on Prefect's windows, process starts and
# the network, so on a 2-core machine two processes take ~21 minutes where one takes ~31.
# Each has its own session (its own Prefect server, its own HARVEST_HOME). TEST_WORKERS=0 runs
# one process, in file order.
TEST_WORKERS ?= 3

test: install
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf .venv .harvest
