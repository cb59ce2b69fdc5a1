#!/usr/bin/env bash
# One call on the GPU machine: install, compiled tests, kernel sweep, benchmarks.
# Usage (from the repository root, on the device machine):
#   bash tools/gpu_session.sh STAGE...     STAGE in: ncuwhole overhead overheadlegacy chunks shared gluontests formulations gluonbench gluonformats ncugluon tests kerneltests sweep chainsweep sharded quick bench codecs train demo e2e
# Logs go to $OUT (or ./out); a short summary is printed last.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
# jax_triton (pure Python) travels as a wheel in .whl/ when the machine has no registry.
if ls .whl/jax_triton-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/jax_triton-*.whl >> "$OUT/install.log" 2>&1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -m pip install --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1; then
  mkdir -p /tmp/jfl-path
  ln -sfn "$PWD/reference" /tmp/jfl-path/jflashloop_reference
  ln -sfn "$PWD/pallas_kernels" /tmp/jfl-path/jflashloop_pallas_kernels
  ln -sfn "$PWD/triton_kernels" /tmp/jfl-path/jflashloop_triton_kernels
  export PYTHONPATH="$PWD:/tmp/jfl-path${PYTHONPATH:+:$PYTHONPATH}"
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
    tests) run_stage tests "${TESTS_LIMIT:-420}" python3 -m pytest -q -n 8 -p no:cacheprovider \
             tests/test_codecs.py tests/test_rotated_codecs.py tests/test_residual.py \
             tests/test_paged_cache.py tests/test_decode_attention.py tests/test_page_quantization.py \
             tests/test_determinism.py ;;
    kerneltests) run_stage kerneltests 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
             tests/test_decode_attention.py tests/test_page_quantization.py tests/test_rotated_codecs.py \
             tests/test_determinism.py ;;
    trainbg) python3 bench/train_ouro.py --out "$OUT/ouro_tiny.npz" --time-budget 240 > "$OUT/train.log" 2>&1 &
             train_pid=$! ; summary+=("train: started in the background") ;;
    waittrain) start=$SECONDS; wait "$train_pid"; summary+=("train: exit $? after waiting $((SECONDS - start)) s") ;;
    sharded) run_stage sharded 120 python3 examples/sharded_decode.py --data 1 --model 1 --tokens 4096 --steps 8 ;;
    sweep) run_stage sweep 140 python3 bench/decode.py --sweep ;;
    chainsweep) run_stage chainsweep 200 python3 bench/decode.py --sweep --sweep-loops 2,4 ;;
    gluontests) run_stage gluontests "${TESTS_LIMIT:-390}" python3 -m pytest -q -n "${TEST_WORKERS:-14}" --maxfail=5 -p no:cacheprovider \
             ${TESTS_K:+-k "$TESTS_K"} tests/test_gluon_decode.py tests/test_chunks.py tests/test_direct_loops.py tests/test_loop_prediction.py ;;
    formulations) run_stage formulations 200 python3 bench/kernel_formulations.py ;;
    gluonbench) run_stage gluonbench "${BENCH_LIMIT:-280}" python3 bench/kernel_formulations.py --device-time \
             --repeats "${BENCH_REPEATS:-48}" ${BENCH_TIMELINE:+--timeline "$BENCH_TIMELINE"} \
             --shapes "${BENCH_SHAPES:-0,1,2,3,4,5}" \
             --names "${BENCH_NAMES:-pallas,public,gluon2-s2w-mx,gluon2-s2w-mg,gluon2-s2w-mx-n1,gluon2-s2w-x}" ;;
    gluonformats) for spec in ${FORMATS_SPECS:-nvfp4:1 int4_rotated:1 int4:2 int4:4}; do
               run_stage "formats-${spec/:/-loop}" "${FORMATS_LIMIT:-120}" python3 bench/kernel_formulations.py --device-time \
                 --shapes 0,1 --repeats "${BENCH_REPEATS:-48}" ${BENCH_TIMELINE:+--timeline "$BENCH_TIMELINE"} --value-format "${spec%%:*}" --loops "${spec##*:}" --names "${FORMATS_NAMES:-pallas,gluon2-s2w,gluon2-s2w-m}" ${FORMATS_ARGS:-}
             done ;;
    ncugluon) profiled=${NCU_FORMULATIONS:-gluon2-s2,gluon2-s4}
             run_stage ncugluon 150 ncu --clock-control none -k regex:int4_pages \
             --launch-count "$(echo "$profiled" | tr ',' '\n' | wc -l)" \
             --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
             --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats ${NCU_EXTRA:-} \
             --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum${NCU_METRICS:+,$NCU_METRICS} \
             python3 bench/kernel_formulations.py --profile "$profiled" --shape 0 ${NCU_PY_ARGS:-} ;;
    ncuwhole) run_stage ncuwhole 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
             python3 bench/kernel_formulations.py --profile "${NCU_WHOLE:-public,gluon2-s2w}" --whole --shape "${NCU_SHAPE:-3}" ;;
    chunks) run_stage chunks 200 python3 bench/chunks.py ;;
    shared) run_stage shared 200 python3 bench/kernel_formulations.py --device-time --shapes 0,2 --names public \
             --shared ;;
    maps) run_stage maps 120 python3 bench/predicted_maps.py ;;
    overhead) run_stage overhead 120 python3 bench/call_overhead.py ;;
    overheadlegacy) run_stage overheadlegacy 120 env JFLASHLOOP_TRITON_TARGET=legacy python3 bench/call_overhead.py ;;
    quick) run_stage quick 150 python3 bench/decode.py --quick --check ;;
    bench) run_stage bench 250 python3 bench/decode.py --json "$OUT/decode.json" --trace "$OUT/trace" ;;
    codecs) run_stage codecs 60 python3 bench/codec_speed.py ;;
    train) run_stage train 420 python3 bench/train_ouro.py --out "$OUT/ouro_tiny.npz" ;;
    demo) run_stage demo 200 python3 -m jflashloop demo ;;
    e2e) run_stage e2e "${E2E_LIMIT:-540}" env XLA_PYTHON_CLIENT_MEM_FRACTION="${E2E_MEM_FRACTION:-0.94}" \
             python3 bench/end_to_end.py --out "$OUT/E2E.md" --plot "$OUT/e2e.png" --trace /tmp/e2e-trace \
             --time-budget "${E2E_BUDGET:-360}" ${E2E_ARGS:-}
         # the trace as one file (the benchmark packs it as /tmp/e2e-trace.tar.gz): its many files would crowd
         # the logs out of what a call returns
         if [ -f /tmp/e2e-trace.tar.gz ]; then mv /tmp/e2e-trace.tar.gz "$OUT/"
         elif [ -d /tmp/e2e-trace ]; then tar czf "$OUT/e2e-trace.tar.gz" -C /tmp e2e-trace; fi
         rm -rf /tmp/e2e-trace ;;
    *) summary+=("unknown stage $stage") ;;
  esac
done
cat "$OUT/environment.txt"
for line in "${summary[@]}"; do echo "$line"; done
for stage in "$@"; do
  name=$stage; [ "$stage" = waittrain ] && name=train
  for log in "$OUT/$name.log" $([ "$stage" = gluonformats ] && ls "$OUT"/formats-*.log 2>/dev/null); do
    [ -f "$log" ] && { echo "===== $(basename "$log" .log) (tail)"; tail -n 25 "$log"; }
  done
done
exit 0
