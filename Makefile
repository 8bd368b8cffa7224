# Quick start: `make demo` (the main job) and `make test`. Both create/reuse a local venv in .venv and
# install what they need: CPU torch 2.13.0 (from the local wheel; never a multi-GB CUDA build), triton,
# then this package with its C++ extension built against that torch.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
DEPS := torch==2.13.0 "triton>=3.0" numpy pytest pytest-benchmark scipy safetensors tqdm

.PHONY: demo test bench install clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m pip install -q --disable-pip-version-check $(DEPS)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests bench/test_bench_ops.py --benchmark-disable

# the main job: speculative decoding with the shipped model pair vs plain autoregressive decoding
demo: $(STAMP)
	$(PY) -m specdec generate --prompt "$$(printf 'import unittest\n\n\nclass TestStack(unittest.TestCase):\n')" --max-new-tokens 256 --compare-ar

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf build *.egg-info specdec/_C*.so
