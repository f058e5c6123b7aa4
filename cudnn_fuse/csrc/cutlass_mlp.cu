// nn.FusedMLP's exact-GELU epilogues as CUTLASS 3 Hopper GEMMs (CUDNN_FUSE_MLP_KERNELS=cutlass):
//
//   forward  : z = x @ w1^T + b1 (stored, the aux output) and y = gelu(z) from ONE GEMM;
//   backward : dz = (dY @ W2) * gelu'(z) from ONE GEMM, z read in the epilogue.
//
// Both compute each element as eager PyTorch does: GELU of the bf16-rounded z, and gelu_backward of
// the bf16-rounded product, in float with erff/expf in aten's order (no fast math). bf16 only, sm_90a.
// Built by bench/build_cutlass.sh into cudnn_fuse/_cutlass_mlp.so and loaded through ctypes
// (cudnn_fuse/cutlass_mlp.py); where it is absent, the torch kernels run.
//
// torch's row-major [rows, n] output is CUTLASS's column-major (M = n, N = rows): the features are
// CUTLASS's rows, so b1 is a per-row bias and both operands stay K-major except W2 in the backward.
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using BF = cutlass::bfloat16_t;

namespace cf {

// aten's GELU (approximate='none') of a bf16 value, in float
__device__ __forceinline__ float gelu_bf16(float z) {
  const float x = float(BF(z));
  const float kAlpha = float(M_SQRT1_2);
  return x * 0.5f * (1.0f + erff(x * kAlpha));
}

// aten's gelu_backward (approximate='none'): dy rounded to bf16 as eager's product is
__device__ __forceinline__ float dgelu_bf16(float dy, float z) {
  const float d = float(BF(dy));
  const float x = z;
  const float kBeta = float(M_2_SQRTPI * M_SQRT1_2 * 0.5);
  const float kAlpha = float(M_SQRT1_2);
  const float cdf = 0.5f * (1.0f + erff(x * kAlpha));
  const float pdf = expf(-0.5f * x * x) * kBeta;
  return d * (cdf + x * pdf);
}

template <class T> struct GeluBf16;
template <> struct GeluBf16<float> {
  CUTLASS_DEVICE float operator()(float z) const { return gelu_bf16(z); }
};
template <int N> struct GeluBf16<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& z) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = gelu_bf16(z[i]);
    return y;
  }
};

template <class T> struct DGeluBf16;
template <> struct DGeluBf16<float> {
  CUTLASS_DEVICE float operator()(float d, float z) const { return dgelu_bf16(d, z); }
};
template <int N> struct DGeluBf16<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& d,
                                                     cutlass::Array<float, N> const& z) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = dgelu_bf16(d[i], z[i]);
    return y;
  }
};

template <bool Fwd, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct Gemm {
  using LayoutA = std::conditional_t<Fwd, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::ColumnMajor;
  using Fusion = std::conditional_t<Fwd,
      cutlass::epilogue::fusion::LinCombPerRowBiasEltActAux<LayoutD, GeluBf16, BF, float, BF, BF>,
      cutlass::epilogue::fusion::LinCombDeEltAct<LayoutD, DGeluBf16, BF, float, BF>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 8, BF, LayoutD, 8, EpilogueSchedule, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF, LayoutA, 8, BF, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Op = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;

// tile configurations (CUTLASS 3 Hopper, TMA warp-specialized): the probe times each
// 0: ping-pong 128x128x64, cluster 2x1   1: ping-pong 128x128x64, cluster 1x1   2: ping-pong 128x128x64, cluster 1x2
// 3: ping-pong 64x256x64, cluster 1x1    4: cooperative 128x256x64, cluster 1x1  5: cooperative 256x128x64, cluster 2x1
constexpr int kConfigs = 6;
template <bool Fwd, int Cfg> struct Pick;
template <bool Fwd> struct Pick<Fwd, 0> { using G = Gemm<Fwd, Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi>; };
template <bool Fwd> struct Pick<Fwd, 1> { using G = Gemm<Fwd, Shape<_128, _128, _64>, Shape<_1, _1, _1>, Ping, PingEpi>; };
template <bool Fwd> struct Pick<Fwd, 2> { using G = Gemm<Fwd, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Ping, PingEpi>; };
template <bool Fwd> struct Pick<Fwd, 3> { using G = Gemm<Fwd, Shape<_64, _256, _64>, Shape<_1, _1, _1>, Ping, PingEpi>; };
template <bool Fwd> struct Pick<Fwd, 4> { using G = Gemm<Fwd, Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>; };
template <bool Fwd> struct Pick<Fwd, 5> { using G = Gemm<Fwd, Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>; };

template <bool Fwd, int Cfg>
typename Pick<Fwd, Cfg>::G::Op::Arguments make_args(int M, int N, int K, const void* A, const void* B, void* D,
                                                     const void* bias, void* aux, int sms, int swizzle, int raster) {
  using Op = typename Pick<Fwd, Cfg>::G::Op;
  using GK = typename Op::GemmKernel;
  auto sA = cutlass::make_cute_packed_stride(typename GK::StrideA{}, make_shape(M, K, 1));
  auto sB = cutlass::make_cute_packed_stride(typename GK::StrideB{}, make_shape(N, K, 1));
  auto sC = cutlass::make_cute_packed_stride(typename GK::StrideC{}, make_shape(M, N, 1));
  auto sD = cutlass::make_cute_packed_stride(typename GK::StrideD{}, make_shape(M, N, 1));
  typename Op::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                              {M, N, K, 1},
                              {static_cast<BF const*>(A), sA, static_cast<BF const*>(B), sB},
                              {{}, nullptr, sC, static_cast<BF*>(D), sD}};
  auto& f = args.epilogue.thread;
  f.alpha = 1.0f;
  f.beta = 0.0f;
  if constexpr (Fwd) {
    f.bias_ptr = static_cast<BF const*>(bias);
    f.aux_ptr = static_cast<BF*>(aux);
    f.dAux = sD;
  } else {
    f.aux_ptr = static_cast<BF const*>(aux);
    f.dAux = sD;
  }
  args.hw_info.sm_count = sms;
  args.scheduler.max_swizzle_size = swizzle;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
  return args;
}

// 0: ran; 1: cannot implement; 2: workspace too small; 3: initialize failed; 4: run failed; 5: bad config
template <bool Fwd, int Cfg>
int launch(int M, int N, int K, const void* A, const void* B, void* D, const void* bias, void* aux, void* ws,
           size_t ws_bytes, int sms, int swizzle, int raster, cudaStream_t stream, size_t* need) {
  using Op = typename Pick<Fwd, Cfg>::G::Op;
  auto args = make_args<Fwd, Cfg>(M, N, K, A, B, D, bias, aux, sms, swizzle, raster);
  size_t n = Op::get_workspace_size(args);
  if (need) *need = n;
  if (A == nullptr) return 0;  // a workspace query
  Op op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (n > ws_bytes) return 2;
  if (op.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 3;
  if (op.run(stream) != cutlass::Status::kSuccess) return 4;
  return cudaPeekAtLastError() == cudaSuccess ? 0 : 4;
}

// One translation unit per (direction, tile) when built in parts (cudnn-fuse build-kernels compiles
// them in parallel): -DCF_TU_FWD=0|1 -DCF_TU_TILE=0..5 defines that launch only; -DCF_TU_MAIN the
// dispatch and the C API only; neither (one nvcc call) defines everything.
#define CF_LAUNCH_PARAMS int M, int N, int K, const void* A, const void* B, void* D, const void* bias, void* aux, \
    void* ws, size_t ws_bytes, int sms, int swizzle, int raster, cudaStream_t stream, size_t* need
#define CF_NAME(F, T) cf_launch_##F##_##T
#define CF_DECL(F, T) int CF_NAME(F, T)(CF_LAUNCH_PARAMS);
#define CF_DEF(F, T) int CF_NAME(F, T)(CF_LAUNCH_PARAMS) { \
    return launch<(F) != 0, T>(M, N, K, A, B, D, bias, aux, ws, ws_bytes, sms, swizzle, raster, stream, need); }
#define CF_DEF_EXPANDED(F, T) CF_DEF(F, T)
CF_DECL(0, 0) CF_DECL(0, 1) CF_DECL(0, 2) CF_DECL(0, 3) CF_DECL(0, 4) CF_DECL(0, 5)
CF_DECL(1, 0) CF_DECL(1, 1) CF_DECL(1, 2) CF_DECL(1, 3) CF_DECL(1, 4) CF_DECL(1, 5)
#if defined(CF_TU_TILE)
CF_DEF_EXPANDED(CF_TU_FWD, CF_TU_TILE)
#elif !defined(CF_TU_MAIN)
CF_DEF(0, 0) CF_DEF(0, 1) CF_DEF(0, 2) CF_DEF(0, 3) CF_DEF(0, 4) CF_DEF(0, 5)
CF_DEF(1, 0) CF_DEF(1, 1) CF_DEF(1, 2) CF_DEF(1, 3) CF_DEF(1, 4) CF_DEF(1, 5)
#endif

#if !defined(CF_TU_TILE)
template <int F>
int dispatch(int cfg, int M, int N, int K, const void* A, const void* B, void* D, const void* bias, void* aux,
             void* ws, size_t ws_bytes, int sms, cudaStream_t s, size_t* need) {
  const int tile = cfg % 16, swizzle = 1 << ((cfg / 16) % 4), raster = (cfg / 64) % 3;
  switch (tile) {
#define CF_CASE(i) case i: return F ? CF_NAME(1, i)(M, N, K, A, B, D, bias, aux, ws, ws_bytes, sms, swizzle, raster, s, need) \
                                    : CF_NAME(0, i)(M, N, K, A, B, D, bias, aux, ws, ws_bytes, sms, swizzle, raster, s, need);
    CF_CASE(0) CF_CASE(1) CF_CASE(2) CF_CASE(3) CF_CASE(4) CF_CASE(5)
#undef CF_CASE
    default: return 5;
  }
}
#endif

}  // namespace cf

#if !defined(CF_TU_TILE)
extern "C" {

// cfg = tile + 16 * log2(swizzle: 1, 2, 4, 8) + 64 * raster (0: heuristic, 1: along M, 2: along N)
int cf_cutlass_configs() { return cf::kConfigs; }

// y, z [rows, n] = gelu(x [rows, k] @ w [n, k]^T + b [n]), z the pre-activation. A null x: workspace query.
int cf_cutlass_linear_gelu_aux(int cfg, int rows, int n, int k, const void* x, const void* w, const void* b,
                               void* y, void* z, void* ws, size_t ws_bytes, int sms, void* stream, size_t* need) {
  return cf::dispatch<1>(cfg, n, rows, k, /*A=*/x ? w : nullptr, /*B=*/x, y, b, z, ws, ws_bytes, sms,
                            static_cast<cudaStream_t>(stream), need);
}

// dz [rows, n] = (dy [rows, k] @ w2 [k, n]) * gelu'(z [rows, n]). A null dy: workspace query.
int cf_cutlass_dgelu(int cfg, int rows, int n, int k, const void* dy, const void* w2, const void* z, void* dz,
                     void* ws, size_t ws_bytes, int sms, void* stream, size_t* need) {
  return cf::dispatch<0>(cfg, n, rows, k, /*A=*/dy ? w2 : nullptr, /*B=*/dy, dz, nullptr, const_cast<void*>(z),
                             ws, ws_bytes, sms, static_cast<cudaStream_t>(stream), need);
}

}  // extern "C"
#endif
