# One command each (see README): `make demo`, `make test`. Both create .venv when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
# Re-install when a requirement or a package definition changes.
STAMP  := $(VENV)/.shardcore-installed
DEPS   := requirements.txt pyproject.toml backends/fsdp2/pyproject.toml backends/xla/pyproject.toml conformance/pyproject.toml

.PHONY: setup demo lint format test conformance conformance-xla clean

setup: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e . -e backends/fsdp2 -e backends/xla -e conformance
	touch $@

demo: setup
	USE_TORCH_XLA=0 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/demo.py

# ruff's settings are in pyproject.toml: pyflakes (undefined names, unused imports), import order,
# and the formatter at one line length
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q -rs tests

conformance: setup
	$(VENV)/bin/shardcore-conformance --backend fsdp2 --world-size 2 --report conformance-report

# The whole XLA matrix (XLA FSDP and SPMD) on 1, 2 and 4 CPU PJRT devices; reports in
# conformance-report/xla-N. Runs every device count, then fails if any failed.
conformance-xla: setup
	status=0; for n in 1 2 4; do \
	  PJRT_DEVICE=CPU $(VENV)/bin/shardcore-conformance --backend xla --world-size $$n --report conformance-report/xla-$$n || status=1; \
	done; exit $$status

clean:
	rm -rf $(VENV)
