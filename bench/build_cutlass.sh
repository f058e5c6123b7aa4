#!/usr/bin/env bash
# Build cudnn_fuse/_cutlass_mlp.so (nn.FusedMLP's CUTLASS epilogues) into this checkout, for runs that
# import the package from source: the same build as `cudnn-fuse build-kernels`.
#   CUTLASS_DIR=/path/to/cutlass [NVCC=/path/to/nvcc] bash bench/build_cutlass.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CUTLASS_DIR:?set CUTLASS_DIR to a CUTLASS 3 checkout}"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-python3} -m cudnn_fuse build-kernels --cutlass-dir "$CUTLASS_DIR" \
    ${NVCC:+--nvcc "$NVCC"} --output cudnn_fuse/_cutlass_mlp.so
