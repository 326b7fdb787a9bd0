// The CUDA backend's Hopper path with the statistics in the GEMM epilogue (docs/design.md, "The statistics in
// the GEMM epilogue"): CUTLASS 3 sm90 kernels (TMA loads, WGMMA, warp-specialised persistent cooperative
// schedule, 128 x 256 x 64 tiles, 2 x 1 cluster) whose epilogue visitor tree (EVT) reads each fp32 logit tile
// from the accumulator registers:
//
//   Sm90EpilogueStatistics  the forward and the recompute: no logits stored; per (row, vocabulary tile) the
//                           partials (m, t, e) of epilogue_math.h and, from the tile holding it, the target logit.
//                           epilogue_merge_kernel merges a row's tiles with math.h's state_merge / finalize_row.
//   Sm90EpilogueDlogits     the backward: the accumulator becomes d loss / d x (math.h's dz formula, fp32 inside)
//                           and the collective stores it in the operands' dtype by TMA, for the d hidden and
//                           d weight products; no fp32 tile, no fold, no dx sweep.
//
// GEMM: A = hidden [N, D] (K-major), B = W [V, D] (K-major: CUTLASS's ColumnMajor B), fp32 accumulators,
// problem (M, N, K) = (tokens, vocabulary columns, D). Built only for sm_90a and only when the CUTLASS headers
// are found (setup.py); sm90_epilogue_*.cu instantiate it per kernel and dtype, so ninja compiles them in
// parallel.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "fusedloss/epilogue_math.h"
#include "sm90_epilogue.h"

namespace fl_epilogue {

using namespace cute;
using cutlass::epilogue::fusion::Sm90AccFetch;
using cutlass::epilogue::fusion::Sm90EVT;
using cutlass::epilogue::fusion::detail::ConsumerStoreArgs;
using cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks;
using cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks;
using cutlass::epilogue::fusion::detail::ProducerLoadArgs;
using cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue;

// What both nodes share: no shared memory, no workspace, no producer loads, per-row values partitioned like the
// tile (an (M, N) view with stride 0 along N: one register per distinct row a thread holds).
struct NodeBase {
  struct SharedStorage {};
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }
};

// The view of a per-row vector `p` ([M] elements) partitioned like this thread's part of tile (m, n).
template <bool ReferenceSrc, class T, class Args>
CUTLASS_DEVICE auto row_vector(T* p, Args const& args) {
  const int M = get<0>(args.problem_shape_mnkl), N = get<1>(args.problem_shape_mnkl);
  Tensor mRow = make_tensor(make_gmem_ptr(p), make_layout(make_shape(M, N), make_stride(_1{}, _0{})));
  return sm90_partition_for_epilogue<ReferenceSrc>(
      local_tile(mRow, take<0, 2>(args.tile_shape_mnk), make_coord(get<0>(args.tile_coord_mnkl),
                                                                    get<1>(args.tile_coord_mnkl))),
      args.epi_tile, args.tiled_copy, args.thread_idx);
}

// -------------------------------------------------------------------------------------------------------------
// Forward statistics (the prototype's node, with the entropy's sum and the logit transform).
// -------------------------------------------------------------------------------------------------------------
template <class CtaTileShapeMNK, bool kEntropy>
struct Sm90EpilogueStatistics : NodeBase {
  using ElementAux = cutlass::bfloat16_t;  // sizes the collective's unused D staging buffer when D is void

  struct Arguments {
    float* ptr_m = nullptr;               // [ceil(V / CTA_N), round_up(N, CTA_M)] tile row maxima
    float* ptr_t = nullptr;               // same shape: sum e^(z - m) without the maximum's own 1
    float* ptr_e = nullptr;               // same shape: sum e^(z - m) (z - m) (kEntropy)
    int64_t const* ptr_target = nullptr;  // [N] target columns; outside [0, V) never matches
    float* ptr_target_logit = nullptr;    // [N] z at the target column, written by the tile that holds it
    float logit_scale = 1.0f;
    float inv_temperature = 1.0f;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_m != nullptr && args.ptr_t != nullptr && (!kEntropy || args.ptr_e != nullptr) &&
           args.ptr_target != nullptr && args.ptr_target_logit != nullptr;
  }

  CUTLASS_HOST_DEVICE Sm90EpilogueStatistics() {}
  CUTLASS_HOST_DEVICE Sm90EpilogueStatistics(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class RState, class RTarget, class GTarget, class GBuf, class CCoord, class Residue, class LaneLayout,
            class LaneCoord>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RState tCrM_, RState tCrT_, RState tCrE_, RTarget tCrTgt_, GTarget tCgTgt_,
                                          GBuf tCgM_, GBuf tCgT_, GBuf tCgE_, CCoord tCcD_, Residue residue_,
                                          LaneLayout lane_layout_MN_, LaneCoord lane_mn_, int row0_, int col0_,
                                          bool tile_in_problem_, Params const& params_)
        : tCrM(tCrM_), tCrT(tCrT_), tCrE(tCrE_), tCrTgt(tCrTgt_), tCgTgt(tCgTgt_), tCgM(tCgM_), tCgT(tCgT_),
          tCgE(tCgE_), tCcD(tCcD_), residue(residue_), lane_layout_MN(lane_layout_MN_), lane_mn(lane_mn_),
          row0(row0_), col0(col0_), tile_in_problem(tile_in_problem_), params(params_) {}

    RState tCrM, tCrT, tCrE;  // each held row's running (m, t, e)
    RTarget tCrTgt;           // each held row's target column relative to col0 (-1: not in this tile)
    GTarget tCgTgt;
    GBuf tCgM, tCgT, tCgE;    // this tile's column of the partial buffers
    CCoord tCcD;              // element coordinates relative to (row0, col0)
    Residue residue;          // (N - row0, V - col0)
    LaneLayout lane_layout_MN;
    LaneCoord lane_mn;
    int row0, col0;
    // false for the tiles wholly outside (N, V) that the persistent scheduler hands out to fill a cluster
    bool tile_in_problem;
    Params const& params;

    CUTLASS_DEVICE void begin() {
      fill(tCrM, -fl::fl_inf());
      fill(tCrT, 0.0f);
      if constexpr (kEntropy) fill(tCrE, 0.0f);
      Tensor g = filter_zeros(tCgTgt);
      Tensor r = filter_zeros(tCrTgt);
      Tensor c = filter_zeros(tCcD, tCgTgt.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r); ++i) {
        const int64_t rel = get<0>(c(i)) < get<0>(residue) ? g(i) - col0 : -1;
        r(i) = (rel >= 0 && rel < size<1>(CtaTileShapeMNK{})) ? int(rel) : -1;
      }
    }

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& frg_acc) {
      Tensor m_mn = tCrM(_, _, _, epi_m, epi_n);
      Tensor t_mn = tCrT(_, _, _, epi_m, epi_n);
      Tensor e_mn = tCrE(_, _, _, epi_m, epi_n);
      Tensor tgt_mn = tCrTgt(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const auto c = c_mn(idx);
        if (get<1>(c) < get<1>(residue)) {  // columns beyond V hold TMA's zero fill
          const float z = fl::epilogue_logit(float(frg_acc[i]), params.logit_scale, params.inv_temperature);
          float e_unused = 0.0f;
          fl::epilogue_add_logit<kEntropy>(m_mn(idx), t_mn(idx), kEntropy ? e_mn(idx) : e_unused, z);
          if (int(get<1>(c)) == tgt_mn(idx)) params.ptr_target_logit[row0 + int(get<0>(c))] = z;
        }
      }
      return frg_acc;
    }

    // After the tile's last subtile: the lanes holding a row merge by shuffles (each warp holds whole rows of the
    // tile, asserted below), then one lane per row writes the tile's partials.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration || !tile_in_problem) return;  // uniform across the CTA: the shuffles stay full
      Tensor m_rows = filter_zeros(tCrM);
      Tensor t_rows = filter_zeros(tCrT);
      Tensor e_rows = filter_zeros(tCrE);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(m_rows); ++i) {
          const int lane = lane_layout_MN(_0{}, cols);
          const float pm = __shfl_down_sync(0xFFFFFFFF, m_rows(i), lane);
          const float pt = __shfl_down_sync(0xFFFFFFFF, t_rows(i), lane);
          float pe = 0.0f, e_unused = 0.0f;
          if constexpr (kEntropy) pe = __shfl_down_sync(0xFFFFFFFF, e_rows(i), lane);
          fl::epilogue_merge<kEntropy>(m_rows(i), t_rows(i), kEntropy ? e_rows(i) : e_unused, pm, pt, pe);
        }
      }
      if (get<1>(lane_mn) == 0) {
        Tensor gm = filter_zeros(tCgM);
        Tensor gt = filter_zeros(tCgT);
        Tensor ge = filter_zeros(tCgE);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(m_rows); ++i) {  // the buffers are padded to whole row tiles
          gm(i) = m_rows(i);
          gt(i) = t_rows(i);
          if constexpr (kEntropy) ge(i) = e_rows(i);
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
    }();
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto lane_mn = idx2crd(right_inverse(lane_layout_MN)(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value == 1,
                  "a row of the tile spans several warps: this node has no shared-memory merge");

    const int M = get<0>(args.problem_shape_mnkl), N = get<1>(args.problem_shape_mnkl);
    const int m = get<0>(args.tile_coord_mnkl), n = get<1>(args.tile_coord_mnkl);
    auto cta_mn = take<0, 2>(args.tile_shape_mnk);

    Tensor tCgTgt = row_vector<ReferenceSrc>(params.ptr_target, args);
    Tensor tCrTgt = make_tensor_like<int>(tCgTgt);
    Tensor tCrM = make_tensor_like<float>(tCgTgt);
    Tensor tCrT = make_tensor_like<float>(tCgTgt);
    Tensor tCrE = make_tensor_like<float>(tCgTgt);

    // Partial buffers, vocabulary-tile-major: (row, tile) at row + tile * round_up(N, CTA_M).
    auto rows_padded = ceil_div(M, size<0>(cta_mn)) * size<0>(cta_mn);
    auto buf_layout = make_layout(make_shape(rows_padded, N), make_stride(_1{}, _0{}));
    auto tile_buf = [&](float* p) {
      Tensor mBuf = make_tensor(make_gmem_ptr(p + int64_t(n) * rows_padded), buf_layout);
      return sm90_partition_for_epilogue<ReferenceSrc>(local_tile(mBuf, cta_mn, make_coord(m, n)), args.epi_tile,
                                                       args.tiled_copy, args.thread_idx);
    };
    Tensor tCgM = tile_buf(params.ptr_m);
    Tensor tCgT = tile_buf(params.ptr_t);
    Tensor tCgE = tile_buf(kEntropy ? params.ptr_e : params.ptr_t);  // never written without entropy

    const int row0 = int(M) - int(get<0>(args.residue_tCcD));
    const int col0 = int(N) - int(get<1>(args.residue_tCcD));
    const bool tile_in_problem = m * size<0>(cta_mn) < M && n * size<1>(cta_mn) < N;
    return ConsumerStoreCallbacks<decltype(tCrM), decltype(tCrTgt), decltype(tCgTgt), decltype(tCgM),
                                  decltype(args.tCcD), decltype(args.residue_tCcD), decltype(lane_layout_MN),
                                  decltype(lane_mn)>(tCrM, tCrT, tCrE, tCrTgt, tCgTgt, tCgM, tCgT, tCgE, args.tCcD,
                                                     args.residue_tCcD, lane_layout_MN, lane_mn, row0, col0,
                                                     tile_in_problem, params);
  }
};

// -------------------------------------------------------------------------------------------------------------
// d logits: the accumulator -> d loss / d x in fp32 (epilogue_dlogit), rounded to D's dtype by the collective.
// -------------------------------------------------------------------------------------------------------------
template <class CtaTileShapeMNK>
struct Sm90EpilogueDlogits : NodeBase {
  struct Arguments {
    int64_t const* ptr_target = nullptr;  // [N] target columns of the whole vocabulary; -1: none
    int64_t target_offset = 0;            // the vocabulary column of this problem's first column
    float const* ptr_coeffs = nullptr;    // [5, coeff_stride]: lse, lse_lo, onehot, constant, logq per row
    int64_t coeff_stride = 0;
    float logit_scale = 1.0f;
    float inv_temperature = 1.0f;
    float chain = 1.0f;
    int log_q = 0;  // whether the c1 log q term is formed
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_target != nullptr && args.ptr_coeffs != nullptr;
  }

  CUTLASS_HOST_DEVICE Sm90EpilogueDlogits() {}
  CUTLASS_HOST_DEVICE Sm90EpilogueDlogits(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class RInt, class RFloat, class GTarget, class GCoef, class CCoord, class Residue>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RInt tCrTgt_, RFloat tCrLse_, RFloat tCrLo_, RFloat tCrA_, RFloat tCrC0_,
                                          RFloat tCrC1_, GTarget tCgTgt_, GCoef tCgLse_, GCoef tCgLo_, GCoef tCgA_,
                                          GCoef tCgC0_, GCoef tCgC1_, CCoord tCcD_, Residue residue_, int col0_,
                                          Params const& params_)
        : tCrTgt(tCrTgt_), tCrLse(tCrLse_), tCrLo(tCrLo_), tCrA(tCrA_), tCrC0(tCrC0_), tCrC1(tCrC1_),
          tCgTgt(tCgTgt_), tCgLse(tCgLse_), tCgLo(tCgLo_), tCgA(tCgA_), tCgC0(tCgC0_), tCgC1(tCgC1_), tCcD(tCcD_),
          residue(residue_), col0(col0_), params(params_) {}

    RInt tCrTgt;
    RFloat tCrLse, tCrLo, tCrA, tCrC0, tCrC1;
    GTarget tCgTgt;
    GCoef tCgLse, tCgLo, tCgA, tCgC0, tCgC1;
    CCoord tCcD;
    Residue residue;
    int col0;
    Params const& params;

    // One load per distinct row held: its target (relative to the tile) and coefficients. Rows beyond N read
    // nothing and get coefficients that give dz = 0 (their D rows are clipped by the TMA store anyway).
    CUTLASS_DEVICE void begin() {
      Tensor c = filter_zeros(tCcD, tCgTgt.stride());
      Tensor g = filter_zeros(tCgTgt);
      Tensor r = filter_zeros(tCrTgt);
      Tensor gl = filter_zeros(tCgLse), gl0 = filter_zeros(tCgLo), ga = filter_zeros(tCgA), gc0 = filter_zeros(tCgC0),
             gc1 = filter_zeros(tCgC1);
      Tensor rl = filter_zeros(tCrLse), rl0 = filter_zeros(tCrLo), ra = filter_zeros(tCrA), rc0 = filter_zeros(tCrC0),
             rc1 = filter_zeros(tCrC1);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r); ++i) {
        const bool in = get<0>(c(i)) < get<0>(residue);
        const int64_t rel = in ? g(i) - params.target_offset - col0 : -1;
        r(i) = (rel >= 0 && rel < size<1>(CtaTileShapeMNK{})) ? int(rel) : -1;
        rl(i) = in ? gl(i) : 0.0f;
        rl0(i) = in ? gl0(i) : 0.0f;
        ra(i) = in ? ga(i) : 0.0f;
        rc0(i) = in ? gc0(i) : 0.0f;
        rc1(i) = in ? gc1(i) : 0.0f;
      }
    }

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                                                             int epi_v, int epi_m, int epi_n,
                                                             cutlass::Array<ElementInput, FragmentSize> const& frg_acc) {
      Tensor tgt = tCrTgt(_, _, _, epi_m, epi_n);
      Tensor lse = tCrLse(_, _, _, epi_m, epi_n), lo = tCrLo(_, _, _, epi_m, epi_n);
      Tensor a = tCrA(_, _, _, epi_m, epi_n), c0 = tCrC0(_, _, _, epi_m, epi_n), c1 = tCrC1(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const float z = fl::epilogue_logit(float(frg_acc[i]), params.logit_scale, params.inv_temperature);
        const fl::EpilogueRowCoeffs k{lse(idx), lo(idx), a(idx), c0(idx), c1(idx)};
        out[i] = fl::epilogue_dlogit(z, int(get<1>(c_mn(idx))) == tgt(idx), k, params.log_q != 0, params.chain);
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    Tensor tCgTgt = row_vector<ReferenceSrc>(params.ptr_target, args);
    auto coef = [&](int k) { return row_vector<ReferenceSrc>(params.ptr_coeffs + k * params.coeff_stride, args); };
    Tensor tCgLse = coef(0), tCgLo = coef(1), tCgA = coef(2), tCgC0 = coef(3), tCgC1 = coef(4);
    Tensor tCrTgt = make_tensor_like<int>(tCgTgt);
    Tensor tCrLse = make_tensor_like<float>(tCgTgt);
    Tensor tCrLo = make_tensor_like<float>(tCgTgt);
    Tensor tCrA = make_tensor_like<float>(tCgTgt);
    Tensor tCrC0 = make_tensor_like<float>(tCgTgt);
    Tensor tCrC1 = make_tensor_like<float>(tCgTgt);
    const int N = get<1>(args.problem_shape_mnkl);
    const int col0 = int(N) - int(get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(tCrTgt), decltype(tCrLse), decltype(tCgTgt), decltype(tCgLse),
                                  decltype(args.tCcD), decltype(args.residue_tCcD)>(
        tCrTgt, tCrLse, tCrLo, tCrA, tCrC0, tCrC1, tCgTgt, tCgLse, tCgLo, tCgA, tCgC0, tCgC1, args.tCcD,
        args.residue_tCcD, col0, params);
  }
};

// -------------------------------------------------------------------------------------------------------------
// The kernels: the common large-GEMM sm90 shape (tuning waits for a GPU timing).
// -------------------------------------------------------------------------------------------------------------
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

template <class Element, class Fusion, class ElementD>
struct Gemm {
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  static constexpr int kAlignmentD = cute::is_void_v<ElementD> ? 1 : 128 / cutlass::sizeof_bits<Element>::value;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignmentD,  // no C
      ElementD, cutlass::layout::RowMajor, kAlignmentD, EpiSchedule, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlignment,
      Element, cutlass::layout::ColumnMajor, kAlignment,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static void info(int* out) {
    using EpiTile = typename CollectiveEpilogue::EpilogueTile;
    const int v[kInfoFields] = {int(Kernel::MaxThreadsPerBlock), int(Kernel::MinBlocksPerMultiprocessor),
                                int(Kernel::SharedStorageSize), int(CollectiveMainloop::DispatchPolicy::Stages),
                                int(size<0>(TileShape{})), int(size<1>(TileShape{})), int(size<2>(TileShape{})),
                                int(size<0>(ClusterShape{})), int(size<1>(ClusterShape{})),
                                int(size<0>(EpiTile{})), int(size<1>(EpiTile{}))};
    for (int i = 0; i < kInfoFields; ++i) out[i] = v[i];
  }
};

template <class Element, bool kEntropy>
using StatisticsGemm = Gemm<Element, Sm90EVT<Sm90EpilogueStatistics<TileShape, kEntropy>, Sm90AccFetch>, void>;
template <class Element>
using DlogitsGemm = Gemm<Element, Sm90EVT<Sm90EpilogueDlogits<TileShape>, Sm90AccFetch>, Element>;

// One launch of `G` with `args` on `stream`: 0, or a cutlass::Status with `error` saying which step failed.
template <class G>
int launch(typename G::Adapter::Arguments const& args, void* workspace, size_t workspace_bytes, cudaStream_t stream,
           char* error, size_t error_len) {
  typename G::Adapter gemm;
  auto fail = [&](cutlass::Status s, const char* where) {
    const cudaError_t cuda = cudaGetLastError();
    snprintf(error, error_len, "%s: %s (CUDA: %s)", where, cutlass::cutlassGetStatusString(s),
             cudaGetErrorString(cuda));
    return int(s);
  };
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return fail(cutlass::Status::kErrorInvalidProblem,
                                                                         "can_implement");
  if (G::Adapter::get_workspace_size(args) > workspace_bytes) return fail(cutlass::Status::kErrorWorkspaceNull,
                                                                          "workspace");
  cutlass::Status s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return fail(s, "initialize");
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return fail(s, "run");
  error[0] = '\0';
  return 0;
}

template <class G>
typename G::Adapter::Arguments mainloop_arguments(const void* hidden, const void* weight, int n, int v, int d) {
  using Kernel = typename G::Kernel;
  using E = typename Kernel::ElementA;
  typename G::Adapter::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {n, v, d, 1};
  args.mainloop = {static_cast<const E*>(hidden), cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {n, d, 1}),
                   static_cast<const E*>(weight), cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {v, d, 1})};
  return args;
}

}  // namespace fl_epilogue
