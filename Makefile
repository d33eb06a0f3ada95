# One command each (see README): `make demo`, `make test`; `make test-fast` while working. Each creates
# .venv when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
# Re-install when a requirement or a package definition changes.
STAMP  := $(VENV)/.shardcore-installed
DEPS   := requirements.txt pyproject.toml backends/fsdp2/pyproject.toml backends/xla/pyproject.toml conformance/pyproject.toml

.PHONY: setup setup-newest demo lint format test test-pinned test-pinned-suite test-newest test-fast profile-tests fuzz conformance conformance-xla clean

setup: $(STAMP)

# uv installs the same pinned requirements as pip would, with parallel downloads and a cache it links
# from: 58 s with an empty cache and 5 s with a warm one, against pip's 4 minutes (which kept no cache
# here for torch's 900 MB wheel). --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set,
# every test process would otherwise compile torch's and transformers' modules again (3 s each).
UV_VERSION := 0.13.8

$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -r requirements.txt
	$(VENV)/bin/uv pip install --python $(PY) --no-deps -e . -e backends/fsdp2 -e backends/xla -e conformance
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

# Both environments at once: the pinned one (torch 2.9.0 with torch_xla) on two pytest workers, and
# the newest torch beside it, its output held in $(NEWEST_LOG) and shown once the pinned suite ends.
# Most multi-process tests wait on rendezvous and start-ups more than they compute, so a third job
# fills the cores' idle time (docs/measurements.md). Fails if either fails.
NEWEST_LOG ?= .test-newest.log

test: lint
	@newest=0; pinned=0; \
	$(MAKE) --no-print-directory test-newest > $(NEWEST_LOG) 2>&1 & newest_pid=$$!; \
	$(MAKE) --no-print-directory test-pinned-suite || pinned=$$?; \
	wait $$newest_pid || newest=$$?; \
	echo "======== the newest torch (make test-newest, run beside the pinned suite; exit $$newest) ========"; \
	cat $(NEWEST_LOG); \
	test $$pinned -eq 0 && test $$newest -eq 0

# Two workers (pytest-xdist). tests/scheduling.py keeps the tests of one module-scoped fixture on one
# worker and starts the longest first.
PYTEST_WORKERS ?= 2
test-pinned: lint test-pinned-suite

test-pinned-suite: setup
	$(PY) -m pytest -q -rs --durations=25 -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

# Where the suite's time goes, serially so that each test's CPU is its own (tests/profile_tests.py):
# the top tests and files by CPU-seconds, every row in profile.json, and each test's wall time in
# tests/costs.json (the order the suite runs in). TESTS narrows it; the costs of the others stay.
TESTS ?= tests
profile-tests: setup
	SHARDCORE_PROFILE=profile.json SHARDCORE_COSTS=tests/costs.json PYTHONPATH=tests \
	  $(PY) -m pytest -q -rs -p no:xdist -p profile_tests $(TESTS)

# The newest torch this machine installs, beside the pinned one (torch_xla 2.9 needs torch 2.9.0, so
# this venv has no XLA backend): the core and FSDP2 tests that start no process, and the FSDP2
# conformance matrix in fp32 at 2 ranks. The torch wheel comes from this machine's /opt/wheels where
# it lies there, else from PyTorch's CPU index; uv caches it like the pinned environment's wheels.
NEWEST_VENV  ?= .venv-newest
NEWEST_TORCH ?= 2.13.0+cpu
NEWEST_LINKS ?= $(if $(wildcard /opt/wheels/torch-$(NEWEST_TORCH)-*),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
NEWEST_STAMP := $(NEWEST_VENV)/.shardcore-installed

setup-newest: $(NEWEST_STAMP)

$(NEWEST_STAMP): $(DEPS)
	test -x $(NEWEST_VENV)/bin/python || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)
	grep -v -e '^torch==' -e '^torch_xla==' requirements.txt > $(NEWEST_VENV)/requirements.txt
	$(NEWEST_VENV)/bin/uv pip install --python $(NEWEST_VENV)/bin/python --compile-bytecode \
	  --find-links $(NEWEST_LINKS) "torch==$(NEWEST_TORCH)" -r $(NEWEST_VENV)/requirements.txt
	$(NEWEST_VENV)/bin/uv pip install --python $(NEWEST_VENV)/bin/python --no-deps -e . -e backends/fsdp2 -e conformance
	touch $@

# The matrix gets the Inductor settings tests/conftest.py gives the pinned suite (it says why; the
# kernels are the same). The compiled TP case is the 4-rank one that certifies torch_compile with
# tp_size on this release (shardcore_fsdp2.tensor_parallel.COMPILED_TP_CERTIFIED).
test-newest: setup-newest
	USE_TORCH_XLA=0 $(NEWEST_VENV)/bin/python -m pytest -q -rs -m "not multiprocess" tests
	USE_TORCH_XLA=0 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_VEC_ISA_OK=1 \
	  $(NEWEST_VENV)/bin/shardcore-conformance --backend fsdp2 --world-size 2 --dtype fp32 \
	  --no-plots -q --report conformance-report/torch-newest
	USE_TORCH_XLA=0 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_VEC_ISA_OK=1 \
	  $(NEWEST_VENV)/bin/shardcore-conformance --backend fsdp2 --world-size 4 --cases dp2-tp2-compile-llama \
	  --no-plots -q --report conformance-report/torch-newest-compiled-tp

# Every test that starts no process (tests/process_guard.py fails collection when a test that
# launches one lacks the multiprocess marker), so it stays fast enough to run after each edit. On
# both workers: the planner's predictions alone take 30 s serially.
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not multiprocess" tests

# The checkpoint fuzz campaign at length (CI runs a bounded, seeded one): FUZZ_EXAMPLES mutated
# checkpoints per family, in-process and on FSDP2 ranks and XLA devices.
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	SHARDCORE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -rs -s tests/test_checkpoint_fuzz.py tests/test_checkpoint_fuzz_ranks.py

conformance: setup
	$(VENV)/bin/shardcore-conformance --backend fsdp2 --world-size 2 --report conformance-report

# The whole XLA matrix (XLA FSDP and SPMD) on 1, 2 and 4 CPU PJRT devices; reports in
# conformance-report/xla-N. Runs every device count, then fails if any failed.
conformance-xla: setup
	status=0; for n in 1 2 4; do \
	  PJRT_DEVICE=CPU $(VENV)/bin/shardcore-conformance --backend xla --world-size $$n --report conformance-report/xla-$$n || status=1; \
	done; exit $$status

clean:
	rm -rf $(VENV) $(NEWEST_VENV)
