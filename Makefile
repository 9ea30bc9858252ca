# Two entry points (see README): `make demo` and `make test`.
# Both create ./.venv on first use with the pinned CPU torch wheel (constraints.txt).
# `make test`: the tests not marked slow (about two minutes on 2 cores); `make slow`: the rest
# (process launches, Inductor compiles, long runs: about ten minutes); CI runs both. On a quiet
# machine: `make perf` (the tests that pass or fail on measured speed; neither leaves them in).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fdp-installed
NPROC  ?= 2
# pytest workers for `make test` / `make slow` (pytest-xdist, one test file per worker at a
# time: a file's module fixtures run once). Most tests run their ranks as threads, which hold
# one core; two workers use both. TEST_WORKERS=0 runs in this process, one test at a time.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo test slow perf lint bench clean

# -qq: the installer's errors only. (setuptools prints an "Editable installation" notice for
# every editable install, a warning block pip shows at -q; the project's output is the tests'.)
$(STAMP): pyproject.toml constraints.txt
	@echo "make: installing fdp (editable), the CPU torch of constraints.txt and the test tools into $(VENV) (first run only)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -c constraints.txt -e '.[test,viz,examples]' ruff
	@touch $(STAMP)
	@echo "make: installed: $$($(PY) -c 'import torch, fdp; print("torch", torch.__version__, "| fdp", fdp.__version__)')"

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train_mlp.py

test: $(STAMP)
	$(PYTEST) -m "not slow"

slow: $(STAMP)
	$(PYTEST) -m slow

perf: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m perf

lint: $(STAMP)
	$(VENV)/bin/ruff check fdp kernels tests examples

bench: $(STAMP)
	$(PY) -m fdp.bench

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
