// Host twin of the prototype's epilogue fold (sm90_softmax_partials.cu), for tests/test_cutlass_prototype.py:
// the same add_logit and merge_partial, applied as the kernel applies them to one tile of rows. The WGMMA
// accumulator layout deals a row's columns to the four lanes of a quad in pairs (lane q holds columns 8j + 2q
// and 8j + 2q + 1); each lane folds its columns in column order (the kernel's order within a lane may differ,
// which changes the rounding only), then shuffles down by 2 and by 1 merge the lanes into lane 0, which writes
// the tile's (m, t). Columns at or beyond `valid` are the tile's zero fill and are skipped, as the kernel's
// residue predicate does.
#include "softmax_partials.h"

extern "C" void fl_proto_fold_tile(const float* z, int rows, int cols, int valid, float* m_out, float* t_out) {
  constexpr int kLanes = 4;
  for (int r = 0; r < rows; ++r) {
    float m[kLanes], t[kLanes];
    for (int q = 0; q < kLanes; ++q) {
      m[q] = -fl::fl_inf();
      t[q] = 0.0f;
    }
    for (int c = 0; c < cols && c < valid; ++c) {
      const int q = (c / 2) % kLanes;
      fl_proto::add_logit(m[q], t[q], z[int64_t(r) * cols + c]);
    }
    for (int d = kLanes / 2; d > 0; d /= 2) {
      for (int q = 0; q + d < kLanes; ++q) fl_proto::merge_partial(m[q], t[q], m[q + d], t[q + d]);
    }
    m_out[r] = m[0];
    t_out[r] = t[0];
  }
}
