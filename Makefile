# Quick start: `make demo` (the main job) and `make test`. Both create/reuse a local venv in .venv and
# install what they need: CPU torch 2.13.0 (from the local wheel; never a multi-GB CUDA build), triton,
# then this package with its C++ extension built against that torch.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
DEPS := torch==2.13.0 "triton>=3.0" numpy pytest pytest-xdist pytest-random-order pytest-benchmark scipy safetensors tqdm hypothesis xgrammar==0.2.8
PIP := $(PY) -m pip install -q --disable-pip-version-check
# the suite on both cores (one torch thread per worker), in a new shuffled order each run so that no test can
# lean on another having run first; `make test TEST_SEED=N` repeats run N's order, PYTEST_ARGS adds options
ifndef TEST_SEED
TEST_SEED := $(shell od -An -N3 -tu4 /dev/urandom | tr -d ' ')
endif
PYTEST_ARGS ?=

.PHONY: demo test check-install bench install clean fuzz engine-envs test-engines

$(PY):
	python3 -m venv $(VENV)

# the newest pip, setuptools and wheel, as a user's environment has them (a new venv brings old ones), so that
# the install takes the path users take; then the package, its C++ ops compiled against the torch present
$(STAMP): $(PY) setup.py pyproject.toml specdec/_cpp_build.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PIP) --upgrade pip setuptools wheel
	$(PIP) $(DEPS)
	$(PIP) --no-build-isolation -e .
	$(PY) -c "import specdec._C" || { echo "the C++ ops (specdec._C) did not build"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	@echo "test order: shuffled with TEST_SEED=$(TEST_SEED) (make test TEST_SEED=$(TEST_SEED) repeats it)"
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal tests bench/test_bench_ops.py \
		--ignore=tests/engines --benchmark-disable --random-order-bucket=global --random-order-seed=$(TEST_SEED) $(PYTEST_ARGS)

# a regular install, a wheel and a plain `pip install .` (C++ ops compiled on first use), each in a new venv and
# checked from outside the checkout (CI runs it too)
check-install:
	bash scripts/check_install.sh

# the main job: speculative decoding with the shipped model pair (adaptive, 0..8 draft tokens a step) vs plain
# autoregressive decoding, the fastest of 3 passes of each, alternating
demo: $(STAMP)
	$(PY) -m specdec generate --prompt "$$(printf 'import unittest\n\n\nclass TestStack(unittest.TestCase):\n')" --max-new-tokens 256 --tree auto --passes 3 --compare-ar

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf build *.egg-info specdec/_C*.so

# the property-based fuzz suite (tests/fuzz/test_fuzz_*.py) long: hypothesis profile "fuzz" (unbounded examples), each
# property run in its own pytest process under a share of FUZZ_MINUTES (default 20); prints what each one found
# and the seed that repeats the run (SPECDEC_FUZZ_SEED=N make fuzz)
FUZZ_MINUTES ?= 20
fuzz: $(STAMP)
	FUZZ_MINUTES=$(FUZZ_MINUTES) $(PY) -m tests.fuzz.strategies

# the tests against the engines as they ship (tests/engines/): each peer's pinned release in a virtualenv of its own
# (scripts/engine_envs.sh: .venv-engines/<peer>-<version>, several GB each), and each test file run by the venv
# its docstring names ("venv: <name>")
ENGINE_ENVS ?= vllm-0.34.0 vllm-0.33.0 sglang-0.5.23
engine-envs:
	bash scripts/engine_envs.sh $(ENGINE_ENVS)

test-engines: engine-envs
	@rc=0; for env in $(ENGINE_ENVS); do \
	  files=$$(grep -lw "venv: $$env" tests/engines/test_*.py 2>/dev/null); \
	  [ -n "$$files" ] || continue; \
	  echo "### $$env: $$files"; \
	  TRITON_INTERPRET=1 .venv-engines/$$env/bin/python -m pytest -q -p no:cacheprovider $$files $(PYTEST_ARGS) || rc=1; \
	done; exit $$rc
