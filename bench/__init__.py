"""specdec benchmarks: `python -m bench` times every op and backend against its PyTorch peers over a
shape grid and writes JSON + markdown under bench/results/ (see bench/run.py; `--help` for options).
`pytest bench/ --benchmark-only` runs the pytest-benchmark suites; bench/gpu.sh is the prepared H200 run.
"""
