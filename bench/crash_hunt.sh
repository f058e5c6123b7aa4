#!/usr/bin/env bash
# The threaded C-path crash (a segmentation fault, 2026-12-04): bench/thread_stress.py on the C call
# path repeated under bench/segv_trace.c (native backtrace of the faulting thread) with launch graphs'
# kernel replays on, off (graph executables), and launch graphs off; then the caller-capture test.
# AB_REPS="1 2 3": then the fix's A/B (bf5b711, docs/decisions.md "The threaded C-path crash"): the stress
# with --memo-churn on the C path built without the fix (the exact key's entry borrowed across is_neg()),
# then with it. REPS_DEFAULT= REPS_NO_KERNEL= REPS_NO_GRAPHS= REPS_TEST= (set, empty) skip the hunt's runs.
# On the device machine, from the repo root, with $OUT set: bash bench/crash_hunt.sh
set -u
OUT=${OUT:?set OUT}
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log=$OUT/crash_hunt_log.txt
bash bench/build_native.sh >> "$log" 2>&1
gcc -O1 -fPIC -shared bench/segv_trace.c -o /tmp/segv_trace.so -ldl >> "$log" 2>&1 || exit 1
SECS=${SECS:-20}
run() {  # run NAME ENV... -- CMD...
    local name=$1; shift
    local s=$SECONDS
    echo "---- $name" >> "$log"
    env CUDNN_FUSE_CACHE_DIR=$(mktemp -d) LD_PRELOAD=/tmp/segv_trace.so "$@" >> "$log" 2>&1
    echo "== $name rc=$? $((SECONDS - s))s" >> "$log"
}
for i in ${REPS_DEFAULT-1 2 3 4}; do
    run "c_path default $i" timeout $((SECS + 25)) python3 -X faulthandler bench/thread_stress.py --seconds "$SECS" --native 1; done
for i in ${REPS_NO_KERNEL-1 2 3}; do
    run "c_path kernel replays off $i" CUDNN_FUSE_KERNEL_REPLAY=0 timeout $((SECS + 25)) python3 -X faulthandler \
        bench/thread_stress.py --seconds "$SECS" --native 1; done
for i in ${REPS_NO_GRAPHS-1 2}; do
    run "c_path launch graphs off $i" CUDNN_FUSE_LAUNCH_GRAPHS=0 timeout $((SECS + 25)) python3 -X faulthandler \
        bench/thread_stress.py --seconds "$SECS" --native 1; done
for i in ${REPS_TEST-1 2 3}; do
    run "callers_capture c_path $i" timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
        tests/test_gpu_native.py -k "callers_capture and c_path"; done
if [ -n "${AB_REPS:-}" ]; then
    python3 - cudnn_fuse/_native.c /tmp/native_without_fix.c <<'PY' || exit 1
import sys
src = open(sys.argv[1]).read()
fixed = src[src.index("    Py_INCREF(entry);\n    if (negated(args) != 0) {"):src.index("    n_keyed++;")]
assert "Py_DECREF(entry);" in fixed, "the fix is not where it was"
old = ("    if (negated(args) != 0)\n        goto none;\n    Py_INCREF(entry);\n")  # bf5b711's parent
open(sys.argv[2], "w").write(src.replace(fixed, old, 1))
PY
    for build in without_fix with_fix; do
        if [ $build = without_fix ]; then
            SRC=/tmp/native_without_fix.c bash bench/build_native.sh >> "$log" 2>&1 || exit 1
        else
            bash bench/build_native.sh >> "$log" 2>&1 || exit 1
        fi
        for i in $AB_REPS; do
            run "memo churn $build $i" timeout $((SECS + 25)) python3 -X faulthandler bench/thread_stress.py \
                --seconds "$SECS" --native 1 --memo-churn; done  # each JSON in the log (few files come back from a device call)
    done
fi
grep "^== \|^segv_trace: signal\|failed_trials\|\"trials\"\|memo_clears" "$log"
