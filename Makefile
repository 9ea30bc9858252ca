# Two entry points (see README): `make demo` and `make test`.
# Both create ./.venv on first use with the pinned CPU torch wheel (constraints.txt).
# While working: `make quick` (the suite without the slow tests: under a minute). On a quiet
# machine: `make perf` (the tests that pass or fail on measured speed; `make test` leaves them out).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fdp-installed
NPROC  ?= 2
# pytest workers for `make test` / `make quick` (pytest-xdist, one test file per worker at a
# time: a file's module fixtures run once). Most tests run their ranks as threads, which hold
# one core; two workers use both. TEST_WORKERS=0 runs in this process, one test at a time.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo test quick perf lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,viz,examples]' ruff
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train_mlp.py

test: $(STAMP)
	$(PYTEST)

quick: $(STAMP)
	$(PYTEST) -m "not slow"

perf: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m perf

lint: $(STAMP)
	$(VENV)/bin/ruff check fdp kernels tests examples

bench: $(STAMP)
	$(PY) -m fdp.bench

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
