// Compile-only prototype: the logits GEMM z = hidden @ W^T with the softmax statistics folded into its
// epilogue (docs/design.md, "Beyond the bound of this design"). Not built by setup.py, not in the wheel, never
// called by the library: tools/cutlass_prototype.py compiles it for sm_90a and reads its resources and SASS;
// benchmarks/cutlass_prototype_device.py calls its host entry points (at the end) on a GPU.
//
// The GEMM is a CUTLASS 3 sm90 kernel (TMA loads, WGMMA, warp-specialised persistent cooperative schedule):
//   A = hidden [N, D] bf16 row-major (K-major), B = W [V, D] bf16 row-major (K-major, i.e. CUTLASS's
//   ColumnMajor B), fp32 accumulators, problem (M, N, K) = (N tokens, V, D).
// Its epilogue stores no logits. An epilogue visitor tree (EVT) node, Sm90RowSoftmaxPartials, reads each fp32
// logit tile from the accumulator registers and writes, per (row, vocabulary tile):
//   m = the tile's row maximum, t = sum over the tile's columns of e^(z - m) without the maximum's own e^0
//   (s = 1 + t: docs/design.md, "Numerical doctrine"; the same (m, t) pair as csrc/fusedloss/math.h's fold),
// and, for the one tile that holds a row's target column, the target logit z_y. Merging a row's tile partials
// (state_merge of math.h) and finishing lse = m + log1p(t), logp = (z_y - m) - log1p(t) stay outside.
//
// Why a custom node and not a stock one: Sm90ColReduction (sm90_visitor_store_tma_warpspecialized.hpp)
// reduces one value per row (in CUTLASS's terms a per-row result is a *column* reduction: it reduces across
// the GEMM's N), with one reduce functor; the softmax needs the pair (m, t), whose merge rescales t by the
// maxima, so the node below is that node's per-row machinery (register state with stride 0 along N, the lane
// shuffle tree, the m-major partial buffer) with the (m, t) merge instead of a functor.
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "softmax_partials.h"  // add_logit, merge_partial: the fold's step and merge, host-tested

namespace fl_proto {

using namespace cute;
using cutlass::epilogue::fusion::Sm90AccFetch;
using cutlass::epilogue::fusion::Sm90EVT;
using cutlass::epilogue::fusion::detail::ConsumerStoreArgs;
using cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks;
using cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks;
using cutlass::epilogue::fusion::detail::ProducerLoadArgs;
using cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue;

// EVT node: consumes its child's fragment (the fp32 logits; Sm90AccFetch here, a softcap or bias node would sit
// between), returns it unchanged (the collective stores nothing: D is void), and writes the row partials.
template <class CtaTileShapeMNK>
struct Sm90RowSoftmaxPartials {
  // The collective sizes its (unused) D staging buffer by this type when D is void; 16-bit keeps it small.
  using ElementAux = cutlass::bfloat16_t;

  struct SharedStorage {};

  struct Arguments {
    float* ptr_m = nullptr;              // [ceil(V / CTA_N), round_up(N, CTA_M)]: tile row maxima
    float* ptr_t = nullptr;              // same shape: sum e^(z - m) without the maximum's own 1
    int64_t const* ptr_target = nullptr; // [N] target columns; outside [0, V) (ignore_index) never matches
    float* ptr_target_logit = nullptr;   // [N] z at the target column, written by the tile that holds it
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_m != nullptr && args.ptr_t != nullptr && args.ptr_target != nullptr &&
           args.ptr_target_logit != nullptr;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;  // the partials go straight to the caller's buffers: no cross-CTA reduction in the kernel
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90RowSoftmaxPartials() {}
  CUTLASS_HOST_DEVICE Sm90RowSoftmaxPartials(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }

  // Register tensors are (CPY, CPY_M, CPY_N, EPI_M, EPI_N) views with stride 0 along N: one (m, t, target)
  // per row a thread holds, kept across the epilogue subtiles of the tile.
  template <class RState, class RTarget, class GTarget, class GBuf, class CCoord, class Residue, class LaneLayout,
            class LaneCoord>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RState tCrM_, RState tCrT_, RTarget tCrTgt_, GTarget tCgTgt_, GBuf tCgM_,
                                          GBuf tCgT_, CCoord tCcD_, Residue residue_, LaneLayout lane_layout_MN_,
                                          LaneCoord lane_mn_, int row0_, int col0_, bool tile_in_problem_,
                                          Params const& params_)
        : tCrM(tCrM_), tCrT(tCrT_), tCrTgt(tCrTgt_), tCgTgt(tCgTgt_), tCgM(tCgM_), tCgT(tCgT_), tCcD(tCcD_),
          residue(residue_), lane_layout_MN(lane_layout_MN_), lane_mn(lane_mn_), row0(row0_), col0(col0_),
          tile_in_problem(tile_in_problem_), params(params_) {}

    RState tCrM, tCrT;  // running maximum and t of each row this thread holds
    RTarget tCrTgt;     // each row's target column relative to col0 (-1: not in this tile)
    GTarget tCgTgt;     // the targets in global memory, same view
    GBuf tCgM, tCgT;    // this tile's column of the partial buffers, same view
    CCoord tCcD;        // element coordinates relative to (row0, col0), compile-time where the layout is static
    Residue residue;    // (N - row0, V - col0): elements at or beyond it are outside the problem
    LaneLayout lane_layout_MN;
    LaneCoord lane_mn;
    int row0, col0;  // global coordinates of this thread's first element
    // false for the tiles wholly outside (N, V) that the persistent scheduler still hands out to fill a cluster
    // (the grid's tiles are rounded up to the 2 x 1 cluster): their rows lie past the padded buffers' end
    bool tile_in_problem;
    Params const& params;

    CUTLASS_DEVICE void begin() {
      fill(tCrM, -fl::fl_inf());
      fill(tCrT, 0.0f);
      // One load per distinct row (filter_zeros drops the stride-0 column modes).
      Tensor g = filter_zeros(tCgTgt);
      Tensor r = filter_zeros(tCrTgt);
      Tensor c = filter_zeros(tCcD, tCgTgt.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r); ++i) {
        const int64_t rel = get<0>(c(i)) < get<0>(residue) ? g(i) - col0 : -1;
        r(i) = (rel >= 0 && rel < size<1>(CtaTileShapeMNK{})) ? int(rel) : -1;
      }
    }

    // One exponential per logit (add_logit, softmax_partials.h).
    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&,
        int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& frg_z) {
      Tensor m_mn = tCrM(_, _, _, epi_m, epi_n);
      Tensor t_mn = tCrT(_, _, _, epi_m, epi_n);
      Tensor tgt_mn = tCrTgt(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const auto c = c_mn(idx);
        // Columns beyond V hold TMA's zero fill and must not count; rows beyond N only fill padding rows.
        if (get<1>(c) < get<1>(residue)) {
          const float z = float(frg_z[i]);
          add_logit(m_mn(idx), t_mn(idx), z);
          if (int(get<1>(c)) == tgt_mn(idx)) {  // rare: one element per row in the whole grid
            params.ptr_target_logit[row0 + int(get<0>(c))] = z;
          }
        }
      }
      return frg_z;
    }

    // After the tile's last subtile: merge the lanes that hold the same rows, then one lane per row writes
    // the tile's (m, t). The WGMMA accumulator layout gives each warp whole rows of the tile (warps split M
    // only, asserted below), so no cross-warp shared-memory step is needed, unlike Sm90ColReduction.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration || !tile_in_problem) return;  // uniform across the CTA: the shuffles stay full
      Tensor m_rows = filter_zeros(tCrM);
      Tensor t_rows = filter_zeros(tCrT);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(m_rows); ++i) {
          const float pm = __shfl_down_sync(0xFFFFFFFF, m_rows(i), lane_layout_MN(_0{}, cols));
          const float pt = __shfl_down_sync(0xFFFFFFFF, t_rows(i), lane_layout_MN(_0{}, cols));
          merge_partial(m_rows(i), t_rows(i), pm, pt);
        }
      }
      if (get<1>(lane_mn) == 0) {
        // The buffers are padded to whole row tiles, so rows beyond N need no predicate.
        Tensor gm = filter_zeros(tCgM);
        Tensor gt = filter_zeros(tCgT);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(m_rows); ++i) {
          gm(i) = m_rows(i);
          gt(i) = t_rows(i);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    // Which lanes and warps of the epilogue's copy share a row (Sm90ColReduction's derivation).
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();  // tile_mn -> tv_idx
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));  // lane_mn -> lane
    auto lane_mn = idx2crd(right_inverse(lane_layout_MN)(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value == 1,
                  "a row of the tile spans several warps: this node has no shared-memory merge");

    const int M = get<0>(args.problem_shape_mnkl), N = get<1>(args.problem_shape_mnkl);
    const int m = get<0>(args.tile_coord_mnkl), n = get<1>(args.tile_coord_mnkl);
    auto cta_mn = take<0, 2>(args.tile_shape_mnk);

    // Targets as an (N, V) view with stride 0 along V: partitioned like the tile, one value per row.
    Tensor mTgt = make_tensor(make_gmem_ptr(params.ptr_target), make_layout(make_shape(M, N), make_stride(_1{}, _0{})));
    Tensor tCgTgt = sm90_partition_for_epilogue<ReferenceSrc>(local_tile(mTgt, cta_mn, make_coord(m, n)),
                                                              args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tCrTgt = make_tensor_like<int>(tCgTgt);
    Tensor tCrM = make_tensor_like<float>(tCgTgt);
    Tensor tCrT = make_tensor_like<float>(tCgTgt);

    // Partial buffers, vocabulary-tile-major: element (row, tile) at row + tile * round_up(N, CTA_M), the
    // non-final layout of Sm90ColReduction, so one CTA's rows are contiguous.
    auto rows_padded = ceil_div(M, size<0>(cta_mn)) * size<0>(cta_mn);
    auto buf_layout = make_layout(make_shape(rows_padded, N), make_stride(_1{}, _0{}));
    auto tile_buf = [&](float* p) {
      Tensor mBuf = make_tensor(make_gmem_ptr(p + int64_t(n) * rows_padded), buf_layout);
      return sm90_partition_for_epilogue<ReferenceSrc>(local_tile(mBuf, cta_mn, make_coord(m, n)), args.epi_tile,
                                                       args.tiled_copy, args.thread_idx);
    };
    Tensor tCgM = tile_buf(params.ptr_m);
    Tensor tCgT = tile_buf(params.ptr_t);

    // The epilogue's coordinates are relative to the thread's first element; residue = (N, V) - that element.
    const int row0 = int(M) - int(get<0>(args.residue_tCcD));
    const int col0 = int(N) - int(get<1>(args.residue_tCcD));
    const bool tile_in_problem = m * size<0>(cta_mn) < M && n * size<1>(cta_mn) < N;
    return ConsumerStoreCallbacks<decltype(tCrM), decltype(tCrTgt), decltype(tCgTgt), decltype(tCgM),
                                  decltype(args.tCcD), decltype(args.residue_tCcD), decltype(lane_layout_MN),
                                  decltype(lane_mn)>(tCrM, tCrT, tCrTgt, tCgTgt, tCgM, tCgT, args.tCcD,
                                                     args.residue_tCcD, lane_layout_MN, lane_mn, row0, col0,
                                                     tile_in_problem, params);
  }
};

// ---------------------------------------------------------------------------------------------------------
// The kernel. 128 x 256 x 64 tiles, cooperative (two consumer warpgroups split the 128 rows, so each warp holds
// whole rows), a 2 x 1 cluster multicasting each W tile to two row blocks: the common large-GEMM sm90 shape;
// tuning waits for a GPU timing.
// ---------------------------------------------------------------------------------------------------------
using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows: D % 8 == 0

using RowSoftmaxPartials = Sm90RowSoftmaxPartials<TileShape>;
using Fusion = Sm90EVT<RowSoftmaxPartials, Sm90AccFetch>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, 1,  // no C: nothing is loaded
    void, cutlass::layout::RowMajor, 1,  // no D: the logits are never stored
    cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::RowMajor, kAlignment,     // hidden [N, D]
    Element, cutlass::layout::ColumnMajor, kAlignment,  // W [V, D] row-major = B (D x V) column-major
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

}  // namespace fl_proto

// ---------------------------------------------------------------------------------------------------------
// Host entry points (extern "C", for ctypes: benchmarks/cutlass_prototype_device.py runs the kernel on a GPU
// through them; docs/design.md, "The CUTLASS 3 prototype (compile-only)"). Host code only: the kernel above is
// what tools/cutlass_prototype.py reads back, unchanged by them.
// ---------------------------------------------------------------------------------------------------------
namespace fl_proto {

// The GEMM's arguments: A = hidden [n, d], B = W [v, d] (both K-major), the partial buffers of the EVT node.
inline typename Gemm::Arguments make_arguments(const void* hidden, const void* weight, int n, int v, int d,
                                               float* part_m, float* part_t, const int64_t* target,
                                               float* target_logit) {
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {n, v, d, 1},
      {static_cast<const Element*>(hidden), cutlass::make_cute_packed_stride(StrideA{}, {n, d, 1}),
       static_cast<const Element*>(weight), cutlass::make_cute_packed_stride(StrideB{}, {v, d, 1})},
      {{}, nullptr, StrideD{}, nullptr, cutlass::make_cute_packed_stride(StrideD{}, {n, v, 1})}};
  args.epilogue.thread = {{}, {part_m, part_t, target, target_logit}};
  return args;
}

// What the last failed call said, for a caller that only sees the status code.
thread_local char last_error[512] = "";

inline int fail(cutlass::Status status, const char* where) {
  const cudaError_t cuda = cudaGetLastError();  // also clears a non-sticky launch error
  snprintf(last_error, sizeof(last_error), "%s: %s (CUDA: %s)", where, cutlass::cutlassGetStatusString(status),
           cudaGetErrorString(cuda));
  return int(status);
}

}  // namespace fl_proto

// One launch on `stream` (a cudaStream_t; torch's current stream works: both runtimes share the device's
// primary context). hidden: [n, d] bf16 and weight: [v, d] bf16, row-major, d % 8 == 0 (16-byte TMA rows).
// part_m, part_t: [ceil(v / 256), round_up(n, 128)] fp32, element (row, tile) at row + tile * round_up(n, 128)
// (rows >= n are padding the kernel may write); target: [n] int64; target_logit: [n] fp32, pre-filled by the
// caller (rows whose target is outside [0, v) are not written). workspace: fusedloss_proto_workspace_bytes
// bytes (nullptr when 0). Asynchronous; returns 0 (cutlass::Status::kSuccess) or a cutlass::Status, with
// fusedloss_proto_last_error saying which step failed and the CUDA error beside it.
extern "C" int fusedloss_proto_softmax_partials(const void* hidden, const void* weight, int n, int v, int d,
                                                float* part_m, float* part_t, const int64_t* target,
                                                float* target_logit, void* workspace, size_t workspace_bytes,
                                                cudaStream_t stream) {
  using namespace fl_proto;
  auto args = make_arguments(hidden, weight, n, v, d, part_m, part_t, target, target_logit);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return fail(cutlass::Status::kErrorInvalidProblem, "can_implement");
  }
  if (Gemm::get_workspace_size(args) > workspace_bytes) return fail(cutlass::Status::kErrorWorkspaceNull, "workspace");
  cutlass::Status status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return fail(status, "initialize");
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return fail(status, "run");
  last_error[0] = '\0';
  return 0;
}

// The workspace the launch needs for (n, v, d), in bytes. Host arithmetic only: no device is touched.
extern "C" size_t fusedloss_proto_workspace_bytes(int n, int v, int d) {
  using namespace fl_proto;
  return Gemm::get_workspace_size(make_arguments(nullptr, nullptr, n, v, d, nullptr, nullptr, nullptr, nullptr));
}

// The message of the calling thread's last failed launch ("" after a successful one).
extern "C" const char* fusedloss_proto_last_error() { return fl_proto::last_error; }

// The kernel's launch shape, for tools/cutlass_prototype.py (host constants only: no device is touched).
// Order: threads per block, min blocks per SM, dynamic shared memory bytes, mainloop stages, CTA tile M, N, K,
// cluster M, N, epilogue subtile M, N.
extern "C" void fusedloss_proto_kernel_info(int* out) {
  using namespace fl_proto;
  using EpiTile = typename CollectiveEpilogue::EpilogueTile;
  const int info[] = {int(GemmKernel::MaxThreadsPerBlock), int(GemmKernel::MinBlocksPerMultiprocessor),
                      int(GemmKernel::SharedStorageSize), int(CollectiveMainloop::DispatchPolicy::Stages),
                      int(size<0>(TileShape{})), int(size<1>(TileShape{})), int(size<2>(TileShape{})),
                      int(size<0>(ClusterShape{})), int(size<1>(ClusterShape{})),
                      int(size<0>(EpiTile{})), int(size<1>(EpiTile{}))};
  for (int i = 0; i < int(sizeof(info) / sizeof(info[0])); ++i) out[i] = info[i];
}
