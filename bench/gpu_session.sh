#!/usr/bin/env bash
# The GPU tests and the benchmark suite on a GPU machine, each step bounded in time, with a fresh plan
# cache, its output appended to $OUT/log.txt and its files under $OUT. From the repo root, with the
# wheels (this package's and its dependencies') in .whl/:
#
#   STEPS="tests_a demo" OUT=/some/dir bash bench/gpu_session.sh
#
# Steps:
#   tests_a      the GPU tests of tests/test_gpu_[a-n]*.py           -> gpu_junit_a.xml
#   tests_b      the other GPU test files and tests/test_hf.py       -> gpu_junit_b.xml
#   optfuzz      the optimize() fuzz, tests/test_gpu_optimize_fuzz.py -> gpu_junit_fuzz.xml,
#                gpu_optimize_fuzz_report.json
#   demo         `cudnn-fuse demo`
#   peers:PART   bench/peers.py --part PART (see `python3 bench/peers.py --list`) -> peers_PART.json
#   memory       bench/memory.py                                     -> memory.json
#   cold         bench/cold_start.py                                 -> cold_start.json
#   host         bench/host_overhead.py                              -> host_overhead.json
#   prewarm      bench/prewarm_scaling.py (needs 2 GPUs)              -> prewarm.json
#   dynamic      bench/dynamic_shapes.py (DYNAMIC_ARGS, e.g. "--models gpt2"; rows of the same run merged into
#                $OUT/dynamic_shapes.json: copy an earlier call's there first to extend it) -> dynamic_shapes.json
#   fp8          bench/fp8.py (FP8_ARGS, e.g. "--shapes 4096x4096x4096") -> fp8.json, fp8.png
#   models:M:D   bench/models.py --models M --modes D (comma-separated; M or D empty: all), rows merged
#                into $OUT/models.json (copy bench/results/models.json there first to extend it) -> models.json
#
# STEPS set but empty: install and build only. Options: TESTS_TIMEOUT (the tests steps' limit, s),
# MEMORY_ARGS, COLD_ARGS, COLD_TIMEOUT, PEERS_ARGS (e.g. "--no-max-autotune"), PEERS_BUDGET, PEERS_DEADLINE,
# PEERS_TIMEOUT, BUDGET (pre-warm's autotune budget per graph, s), MODELS_ARGS (e.g. "--variants eager,cf
# --explain"), MODELS_TIMEOUT, DYNAMIC_ARGS, DYNAMIC_TIMEOUT, COMMIT (the commit models.py records: the machine's copy of the checkout may
# name an older one); SKIP_INSTALL=1: the wheels are
# already in /tmp/site.
set -u
OUT=${OUT:?set OUT}
STEPS=${STEPS-"tests_a demo"}
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
log=$OUT/log.txt
bash bench/build_native.sh >> "$log" 2>&1 || echo "cudnn_fuse._native not built: the Python path runs" >> "$log"
step() {  # step NAME TIMEOUT_S CMD...: a fresh plan cache per step
    local name=$1 t=$2; shift 2
    local s=$SECONDS
    export CUDNN_FUSE_CACHE_DIR=$(mktemp -d)
    timeout "$t" "$@" >> "$log" 2>&1
    echo "== $name rc=$? $((SECONDS - s))s" >> "$log"
}
for s in $STEPS; do
    case $s in
        tests_a|tests_b)  # the GPU tests in two calls: together they outgrow one
            if [ "$s" = tests_a ]; then files=(tests/test_gpu_[a-n]*.py); else
                files=($(ls tests/test_gpu_*.py | grep -v -E 'test_gpu_[a-n]|optimize_fuzz') tests/test_hf.py); fi
            step "$s" "${TESTS_TIMEOUT:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "${files[@]}" \
                --junit-xml="$OUT/gpu_junit_${s#tests_}.xml" ;;
        optfuzz) CUDNN_FUSE_OPT_FUZZ_REPORT="$OUT/gpu_optimize_fuzz_report.json" step optimize_fuzz "${TESTS_TIMEOUT:-300}" \
                python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_optimize_fuzz.py \
                --junit-xml="$OUT/gpu_junit_fuzz.xml" ;;
        demo) step demo 90 python3 -c "import sys; from cudnn_fuse.cli import main; sys.exit(main(['demo']))" ;;
        peers:*) step "$s" "${PEERS_TIMEOUT:-420}" python3 bench/peers.py --part "${s#peers:}" \
                     --budget-s "${PEERS_BUDGET:-320}" --deadline-s "${PEERS_DEADLINE:-370}" --out "$OUT/peers_${s#peers:}.json" ${PEERS_ARGS:-} ;;
        memory) step memory 120 python3 bench/memory.py --out "$OUT" ${MEMORY_ARGS:-} ;;
        cold) step cold_start "${COLD_TIMEOUT:-240}" python3 bench/cold_start.py --out "$OUT" ${COLD_ARGS:-} ;;
        host) step host_overhead 60 python3 bench/host_overhead.py --out "$OUT" --rounds 3 ;;
        prewarm) step prewarm 240 python3 bench/prewarm_scaling.py --out "$OUT" --budget-s "${BUDGET:-3}" ;;
        dynamic) step dynamic "${DYNAMIC_TIMEOUT:-400}" python3 bench/dynamic_shapes.py --out "$OUT" \
                     ${COMMIT:+--commit "$COMMIT"} ${DYNAMIC_ARGS:-} ;;
        fp8) step fp8 "${FP8_TIMEOUT:-300}" python3 bench/fp8.py --out "$OUT" ${COMMIT:+--commit "$COMMIT"} \
                 ${FP8_ARGS:-} ;;
        models:*) spec=${s#models:}; m=${spec%%:*}; d=${spec#*:}; [ "$d" = "$spec" ] && d=""
                  step "$s" "${MODELS_TIMEOUT:-400}" python3 bench/models.py --out "$OUT" ${m:+--models "$m"} \
                      ${d:+--modes "$d"} ${COMMIT:+--commit "$COMMIT"} ${MODELS_ARGS:-} ;;
        *) echo "unknown step $s" >> "$log" ;;
    esac
done
grep -a "^== \|passed\|failed\| peak " "$log" | tail -60
