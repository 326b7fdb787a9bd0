// Host twins of the sm_90 epilogue kernels (sm90_epilogue.cuh), for tests/contract/test_cuda_epilogue_twins.py (compiled with
// the host compiler, loaded with ctypes): the same epilogue_math.h functions, applied as the kernels apply them.
//
// The WGMMA accumulator layout deals a row's columns to the four lanes of a quad in pairs (lane q holds columns
// 8j + 2q and 8j + 2q + 1 of the tile); each lane folds its columns in column order (the kernel's order within a
// lane may differ, which changes the rounding only), then shuffles down by 2 and by 1 merge the lanes into lane 0,
// which writes the tile's (m, t, e). Columns at or beyond `valid` are the tile's zero fill, skipped as the
// kernel's residue predicate skips them.
#include <cstdint>

#include "fusedloss/epilogue_math.h"

namespace {

template <bool kEntropy>
void fold_tile(const float* acc, int rows, int cols, int valid, float logit_scale, float inv_temperature,
               const int64_t* target_rel, float* m_out, float* t_out, float* e_out, float* target_logit) {
  constexpr int kLanes = 4;
  for (int r = 0; r < rows; ++r) {
    float m[kLanes], t[kLanes], e[kLanes];
    for (int q = 0; q < kLanes; ++q) {
      m[q] = -fl::fl_inf();
      t[q] = 0.0f;
      e[q] = 0.0f;
    }
    for (int c = 0; c < cols && c < valid; ++c) {
      const int q = (c / 2) % kLanes;
      const float z = fl::epilogue_logit(acc[int64_t(r) * cols + c], logit_scale, inv_temperature);
      fl::epilogue_add_logit<kEntropy>(m[q], t[q], e[q], z);
      if (target_rel[r] == c) target_logit[r] = z;
    }
    for (int d = kLanes / 2; d > 0; d /= 2) {
      for (int q = 0; q + d < kLanes; ++q) fl::epilogue_merge<kEntropy>(m[q], t[q], e[q], m[q + d], t[q + d], e[q + d]);
    }
    m_out[r] = m[0];
    t_out[r] = t[0];
    e_out[r] = kEntropy ? e[0] : 0.0f;
  }
}

}  // namespace

extern "C" {

int fl_epilogue_num_outputs() { return fl::kNumOutputs; }

// One (rows x cols) accumulator tile -> per-row (m, t, e) and, where target_rel[r] is a column of the tile, the
// target logit (left as it was elsewhere).
void fl_epilogue_fold_tile(const float* acc, int rows, int cols, int valid, float logit_scale, float inv_temperature,
                           int entropy, const int64_t* target_rel, float* m_out, float* t_out, float* e_out,
                           float* target_logit) {
  (entropy ? fold_tile<true> : fold_tile<false>)(acc, rows, cols, valid, logit_scale, inv_temperature, target_rel,
                                                 m_out, t_out, e_out, target_logit);
}

// epilogue_merge_kernel's row: tile j's partials at [j * stride + row]; target: [rows] or null; out:
// [kNumOutputs, rows].
void fl_epilogue_finalize(const float* m, const float* t, const float* e, int rows, int tiles, int64_t stride,
                          const float* target_logit, const int64_t* target, int entropy, float* out) {
  float row_out[fl::kNumOutputs];
  for (int r = 0; r < rows; ++r) {
    const bool targets = target != nullptr, ignored = targets && target[r] < 0;
    if (entropy) {
      fl::epilogue_finalize_row<true>(m + r, t + r, e + r, tiles, stride, target_logit[r], targets, ignored, row_out);
    } else {
      fl::epilogue_finalize_row<false>(m + r, t + r, e + r, tiles, stride, target_logit[r], targets, ignored, row_out);
    }
    for (int k = 0; k < fl::kNumOutputs; ++k) out[int64_t(k) * rows + r] = row_out[k];
  }
}

// The d logits node on a (rows x cols) accumulator tile whose first column is vocabulary column col0:
// coeffs [5, rows] (lse, lse_lo, onehot, constant, logq), targets [rows] of the whole vocabulary; out in
// dtype (0 fp32, 1 bf16, 2 fp16: math.h's codes, rounded to nearest even as the collective's converter).
void fl_epilogue_dlogits(const float* acc, int rows, int cols, int64_t col0, const int64_t* targets,
                         const float* coeffs, float logit_scale, float inv_temperature, float chain, int log_q,
                         int dtype, void* out) {
  for (int r = 0; r < rows; ++r) {
    const fl::EpilogueRowCoeffs k{coeffs[r], coeffs[rows + r], coeffs[2 * rows + r], coeffs[3 * rows + r],
                                  coeffs[4 * rows + r]};
    for (int c = 0; c < cols; ++c) {
      const int64_t i = int64_t(r) * cols + c;
      const float z = fl::epilogue_logit(acc[i], logit_scale, inv_temperature);
      const float dx = fl::epilogue_dlogit(z, targets[r] == col0 + c, k, log_q != 0, chain);
      if (dtype == fl::kBFloat16) {
        static_cast<fl::bf16*>(out)[i] = fl::from_float<fl::bf16>(dx);
      } else if (dtype == fl::kFloat16) {
        static_cast<fl::fp16*>(out)[i] = fl::from_float<fl::fp16>(dx);
      } else {
        static_cast<float*>(out)[i] = dx;
      }
    }
  }
}

}  // extern "C"
