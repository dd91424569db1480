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

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf .venv .harvest
