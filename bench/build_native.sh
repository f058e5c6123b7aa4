#!/usr/bin/env bash
# Build cudnn_fuse._native into this checkout, for runs that import the package from source
# (PYTHONPATH, as bench/gpu_session.sh does) rather than from an install: one C file, only
# Python's headers, about a second. Usage, from the repo root: bash bench/build_native.sh
# (CC and PYTHON pick the compiler and the interpreter.)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
inc=$($py -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$($py -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
${CC:-gcc} -O2 -std=c11 -Wall -fPIC -shared -I"$inc" cudnn_fuse/_native.c -o "cudnn_fuse/_native$suffix"
$py -c "from cudnn_fuse import ops; print('cudnn_fuse._native:', 'C path' if ops.native_enabled() else 'Python path')"
