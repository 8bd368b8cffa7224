#!/usr/bin/env bash
# The peers' real releases, each in a virtualenv of its own (a peer pins its own torch: never the main venv's),
# for the tests against the engines as they ship (tests/engines/, `make test-engines`):
#   .venv-engines/vllm-0.34.0    vLLM 0.34.0 (its model runner MRv2) with FlashInfer 0.7.4
#   .venv-engines/vllm-0.33.0    vLLM 0.33.0 (the last release with vllm/v1/sample/rejection_sampler.py)
#   .venv-engines/sglang-0.5.23  SGLang 0.5.23
# Each holds specdec too (the checkout, editable, without the C++ ops: the peers' torch is a CUDA build the
# extension would need compiling against), pytest, hypothesis and scipy. Usage: scripts/engine_envs.sh [NAME...]
# (default: all); an env whose stamp file is newer than this script is kept. Several GB each: the registry
# serves them in minutes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
envs=$root/.venv-engines
mkdir -p "$envs"
TEST_DEPS=(pytest pytest-xdist hypothesis scipy numpy)

install() {  # install NAME: create or refresh .venv-engines/NAME
  local name=$1 venv=$envs/$1
  local stamp=$venv/.specdec-engine-env
  if [ -f "$stamp" ] && [ "$stamp" -nt "$0" ]; then echo "engine-envs: $name is ready"; return 0; fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip setuptools wheel
  case "$name" in
    vllm-0.34.0)
      # vllm 0.34.0 pins flashinfer-python==0.7.3, which the registry lacks: its other requirements with 0.7.4 in
      # that pin's place, then vllm itself without dependencies
      local tmp; tmp=$(mktemp -d)
      "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps vllm==0.34.0 -d "$tmp"
      unzip -p "$tmp"/vllm-0.34.0-*.whl 'vllm-0.34.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
        | grep -v 'extra ==' | sed 's/^flashinfer-python==0.7.3$/flashinfer-python==0.7.4/' >"$tmp/requirements.txt"
      "${pip[@]}" -r "$tmp/requirements.txt"
      "${pip[@]}" --no-deps "$tmp"/vllm-0.34.0-*.whl
      rm -rf "$tmp" ;;
    vllm-0.33.0) "${pip[@]}" vllm==0.33.0 ;;
    sglang-0.5.23) "${pip[@]}" sglang==0.5.23 ;;
    *) echo "engine-envs: unknown env $name" >&2; return 2 ;;
  esac
  "${pip[@]}" "${TEST_DEPS[@]}"
  SPECDEC_NO_CPP=1 "${pip[@]}" --no-deps --no-build-isolation -e "$root"
  "$venv/bin/python" -c "import specdec, torch; print('engine-envs: $name: torch', torch.__version__)"
  touch "$stamp"
}

for name in "${@:-vllm-0.34.0 vllm-0.33.0 sglang-0.5.23}"; do
  for n in $name; do install "$n"; done
done
