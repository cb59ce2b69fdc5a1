#!/usr/bin/env bash
# One call on the GPU machine: install, compiled tests, kernel sweep, benchmarks.
# Usage (from the repository root, on the device machine):
#   bash tools/gpu_session.sh STAGE...     STAGE in: tests sweep quick bench codecs train demo
# Logs go to $OUT (or ./out); a short summary is printed last.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
if ! python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  mkdir -p /tmp/jfl-path
  ln -sfn "$PWD/reference" /tmp/jfl-path/jflashloop_reference
  ln -sfn "$PWD/pallas_kernels" /tmp/jfl-path/jflashloop_pallas_kernels
  export PYTHONPATH="$PWD:/tmp/jfl-path"
  echo "editable install failed; using PYTHONPATH" >> "$OUT/install.log"
fi
{ python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())";
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv; } > "$OUT/environment.txt" 2>&1
summary=()
run_stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  summary+=("$name: exit $status in $((SECONDS - start)) s")
}
for stage in "$@"; do
  case $stage in
    tests) run_stage tests 230 python3 -m pytest -q -x -n 8 -p no:cacheprovider \
             tests/test_reference.py tests/test_codecs.py tests/test_residual.py \
             tests/test_paged_cache.py tests/test_decode_kernel.py ;;
    sweep) run_stage sweep 140 python3 bench/decode.py --sweep ;;
    quick) run_stage quick 100 python3 bench/decode.py --quick --check ;;
    bench) run_stage bench 420 python3 bench/decode.py --json "$OUT/decode.json" --trace "$OUT/trace" ;;
    codecs) run_stage codecs 60 python3 bench/codec_speed.py ;;
    train) run_stage train 420 python3 bench/train_ouro.py --out "$OUT/ouro_tiny.npz" ;;
    demo) run_stage demo 200 python3 -m jflashloop.cli demo ;;
    *) summary+=("unknown stage $stage") ;;
  esac
done
cat "$OUT/environment.txt"
for line in "${summary[@]}"; do echo "$line"; done
for stage in "$@"; do
  [ -f "$OUT/$stage.log" ] && { echo "===== $stage (tail)"; tail -n 25 "$OUT/$stage.log"; }
done
