// Host-side declarations of the sm_90 epilogue kernels (sm90_epilogue.cuh; docs/design.md, "The statistics in the
// GEMM epilogue"): what bindings.cpp calls. No CUTLASS or CUDA header here, so that the bindings compile with the
// host compiler alone. Pointers and the stream are integers (as in args.h); every launcher returns 0 or a
// cutlass::Status code and writes what failed into `error`.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fl_epilogue {

// kernel_info's fields: threads per block, min blocks per SM, dynamic shared memory bytes, mainloop stages,
// CTA tile M, N, K, cluster M, N, epilogue subtile M, N.
constexpr int kInfoFields = 11;
constexpr int kTileM = 128;  // the row tile: the partial buffers are padded to a multiple of it
constexpr int kTileN = 256;  // the vocabulary tile: one partial per (row, tile of kTileN columns)
constexpr int kCoeffRows = 5;  // lse, lse_lo, onehot, constant, logq (EpilogueRowCoeffs)

struct StatisticsLaunch {
  int64_t hidden = 0, weight = 0;       // [n, d], [v, d], bf16 (dtype 1) or fp16 (dtype 2), row-major
  int n = 0, v = 0, d = 0, dtype = 1;
  bool entropy = false;
  int64_t part_m = 0, part_t = 0, part_e = 0;  // [ceil(v / kTileN), round_up(n, kTileM)] fp32
  int64_t target = 0, target_logit = 0;         // [n] int64, [n] fp32 (pre-filled by the caller)
  float logit_scale = 1.0f, inv_temperature = 1.0f;
  int64_t stream = 0;
};

struct MergeLaunch {
  int64_t part_m = 0, part_t = 0, part_e = 0;  // as StatisticsLaunch
  int64_t target_logit = 0;                     // [n] fp32
  int64_t target = 0;                           // [n] int64 (0: no targets): a negative one zeroes the row
  int64_t out = 0;                              // [kNumOutputs, n] fp32, problem.Statistics' order
  int n = 0, tiles = 0;
  int64_t stride = 0;                           // round_up(n, kTileM)
  bool entropy = false;
  int64_t stream = 0;
};

struct DlogitsLaunch {
  int64_t hidden = 0, weight = 0;  // [n, d], [v, d]: the recompute's rows and vocabulary columns
  int n = 0, v = 0, d = 0, dtype = 1;
  int64_t out = 0, ld_out = 0;     // [n, v] in the operands' dtype, row stride ld_out (a multiple of 8)
  int64_t target = 0, target_offset = 0;  // [n] int64 of the whole vocabulary; the first column's index
  int64_t coeffs = 0, coeff_stride = 0;   // [kCoeffRows, coeff_stride] fp32
  float logit_scale = 1.0f, inv_temperature = 1.0f, chain = 1.0f;
  bool log_q = false;
  int64_t stream = 0;
};

int statistics(const StatisticsLaunch& a, char* error, size_t error_len);
int merge(const MergeLaunch& a, char* error, size_t error_len);
int dlogits(const DlogitsLaunch& a, char* error, size_t error_len);
void statistics_info(int dtype, bool entropy, int* out);  // kInfoFields host constants, no device touched
void dlogits_info(int dtype, int* out);

}  // namespace fl_epilogue
