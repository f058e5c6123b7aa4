#!/usr/bin/env bash
# cudnn_fuse._native under AddressSanitizer, on the CPU machine: builds the module with -fsanitize=address
# into this checkout (the normal build is put back at the end, even on failure), and runs the given
# pytest arguments (default: the C path's tests) with libasan preloaded and PYTHONMALLOC=malloc, so that a
# freed Python object is freed memory ASan can see. A use-after-free in the C call is reported with its
# line (the borrowed memo entry of bf5b711 was: native_call, heap-use-after-free), in /tmp/asan_native.<pid>.
#   bash bench/asan_native.sh                       # tests/test_native.py tests/test_fastpath.py ...
#   bash bench/asan_native.sh tests -x              # the whole CPU suite (about 3x slower)
# ASan holds freed memory back (its quarantine), so a freed output's address is not handed out again at
# once: tests/test_host_harness.py, whose stand-in plan captures only a pointer set seen before, then
# fails. ASAN_OPTIONS=detect_leaks=0:log_path=/tmp/asan_native:quarantine_size_mb=0 runs it as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
asan=$(${CC:-gcc} -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "no libasan.so for ${CC:-gcc}" >&2; exit 2; }
# libstdc++ preloaded beside it: otherwise ASan cannot find the real __cxa_throw when cudnn-frontend's C++
# throws (an "AddressSanitizer: CHECK failed" that ends the run with status 1 and no report)
preload="$asan $(${CC:-gcc} -print-file-name=libstdc++.so.6)"
trap 'bash bench/build_native.sh > /dev/null' EXIT  # the normal build back
NATIVE_CFLAGS="-O1 -g -fsanitize=address -fno-omit-frame-pointer" CHECK=0 bash bench/build_native.sh
[ $# -gt 0 ] || set -- tests/test_native.py tests/test_fastpath.py tests/test_launch_graphs.py tests/test_capture_releases.py
# reports go to a file too (log_path): pytest's capture swaps file descriptor 2 during each test
LD_PRELOAD=$preload ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:log_path=/tmp/asan_native} PYTHONMALLOC=malloc $py -m pytest -q -p no:cacheprovider "$@"
