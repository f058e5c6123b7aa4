#!/usr/bin/env bash
# Build cudnn_fuse/_cutlass_mlp.so (CUDNN_FUSE_MLP_KERNELS=cutlass) from cudnn_fuse/csrc/cutlass_mlp.cu:
# needs nvcc (CUDA 12.3+, sm_90a) and CUTLASS 3's headers (CUTLASS_DIR: a checkout holding include/ and
# tools/util/include). Optional: where it is absent the FusedMLP node runs torch's kernels.
#   CUTLASS_DIR=/path/to/cutlass NVCC=/path/to/nvcc bash bench/build_cutlass.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CUTLASS_DIR:?set CUTLASS_DIR to a CUTLASS checkout}"
${NVCC:-nvcc} -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -diag-suppress 20012 -Xcompiler=-fPIC -shared \
    -DNDEBUG -I"$CUTLASS_DIR/include" -I"$CUTLASS_DIR/tools/util/include" ${CUTLASS_NVCC_FLAGS:-} \
    cudnn_fuse/csrc/cutlass_mlp.cu -o cudnn_fuse/_cutlass_mlp.so
echo "built cudnn_fuse/_cutlass_mlp.so"
