// Launch arguments of the kernels, shared by the device launchers (kernels.cu), the host loops
// (host.cpp) and the Python bindings (bindings.cpp). Plain C++: no CUDA or torch header, so the
// bindings compile with the host compiler and the extension does not depend on the torch C++ ABI.
//
// Pointers travel as integers (tensor.data_ptr() on the Python side); dtypes as fl::DType codes.
// A row r of a tile lives at x + r * ld (elements). Per-row arrays (targets, state, outputs, coefficients)
// are already offset to the first row of the tile by the caller; `*_stride` is the distance between
// consecutive fields of the same row (e.g. N for the [8, N] output tensor).
#pragma once

#include <cstdint>

#include "math.h"

namespace fl {

// Per-row running-state fields: m, s, e, mt, st, a, b, zy (target logit), s2, sz, mb (max before the target),
// t (s - 1 without the maximum's own term).
enum StateField : int { kM = 0, kS, kE, kMt, kSt, kA, kB, kZy, kS2, kSz, kMb, kT, kStateFields };

struct TileArgs {
  // Student and (optional) teacher raw products x = h @ W.T for `rows` rows and vocabulary columns
  // [v0, v0 + cols); same dtype and leading dimension for both.
  uint64_t x = 0, xt = 0;
  int dtype = kFloat32;
  int64_t ld = 0;
  int64_t rows = 0, cols = 0, v0 = 0;
  uint64_t bias = 0, teacher_bias = 0;  // [V] (indexed by v0 + col), 0 when absent
  int bias_dtype = kFloat32, teacher_bias_dtype = kFloat32;
  Transform tf, teacher_tf;
  uint64_t targets = 0;  // int64 [rows], -1 = ignored row; 0 = no targets (every row valid)
  // Flags.
  bool want_entropy = false, want_kl_rev = false, want_kl_fwd = false;
  bool want_mean_logit = false, want_extras = false;
  int64_t vocab = 0;  // V (mean_logit = sum z / V)
  bool first = true, last = true;  // first tile of the vocabulary (initialise), last tile (finalise)
  // Running state: float [kStateFields, state_stride].
  uint64_t state = 0;
  int64_t state_stride = 0;
  // Outputs: float [kNumOutputs, out_stride] (written on the last tile; zeros on ignored rows).
  uint64_t out = 0;
  int64_t out_stride = 0;
  // JSD second pass: beta in (0, 1); accumulators float [2, acc_stride] (kl_qm, kl_pm).
  JsdConsts jsd{0.5f, 0.0f, 0.0f};
  bool has_jsd = false;
  uint64_t jsd_acc = 0;
  int64_t jsd_acc_stride = 0;
  // Gradient: coefficients float [7, coeff_stride] (a, c0..c5); lse / lse_t read from `out`.
  uint64_t coeffs = 0;
  int64_t coeff_stride = 0;
  uint64_t dx = 0;  // output tile (may alias x when dx_dtype == dtype and dx_ld == ld)
  int dx_dtype = kFloat32;
  int64_t dx_ld = 0;
  int device = 0;
};

struct GrpoArgs {
  int64_t n = 0;
  int dtype = kFloat32;    // kFloat32 or kFloat64: every array below (outputs included) and the compute type
  uint64_t logp = 0;       // [n]
  uint64_t old_logp = 0;   // [n] or 0 (on-policy: ratio 1)
  uint64_t logratio = 0;   // [n] or 0; when set, r = exp(logratio) (sequence level)
  uint64_t adv = 0;        // [n]
  uint64_t mask = 0;       // [n] (0/1 or weights); 0 = all ones. Token level: log r = 0 where mask == 0
  uint64_t iw = 0;         // [n] or 0
  uint64_t ref = 0;        // [n] or 0
  uint64_t weight = 0;     // [n] or 0 (weight 1)
  GrpoParams params{kGrpoClip, 0.2, 0.2, 0, 0.0, 0.0, 0.8, 1.2};
  // Outputs [kGrpoOutputs, n]: loss, dlogp, dlogratio, kl, is_low, is_high, is_region, ratio.
  uint64_t out = 0;
  int device = 0;
};
constexpr int kGrpoOutputs = 8;

struct DpoArgs {
  int64_t n = 0;  // pairs
  int dtype = kFloat32;  // kFloat32 or kFloat64 (arrays and compute type)
  uint64_t logp_c = 0, logp_r = 0, ref_c = 0, ref_r = 0;  // [n]
  uint64_t n_c = 0, n_r = 0;                              // [n] token counts (ipo) or 0 (count 1)
  DpoParams params{kDpoSigmoid, 0.1, 0.0, 1.0, 5.0, 1.0};
  uint64_t out = 0;  // [3, n]: loss, d_chosen, d_rejected
  int device = 0;
};

// Device launchers (kernels.cu); `stream` is a cudaStream_t as an integer. Throw std::runtime_error.
void fold_tile(const TileArgs& a, uint64_t stream);
void jsd_tile(const TileArgs& a, uint64_t stream);
void dx_tile(const TileArgs& a, uint64_t stream);
void grpo_tokens(const GrpoArgs& a, uint64_t stream);
void dpo_pairs(const DpoArgs& a, uint64_t stream);
int cuda_device_count();  // 0 when no device or driver is usable

// Host loops over CPU pointers (host.cpp): the same math, for tests without a GPU.
void host_fold_tile(const TileArgs& a);
void host_jsd_tile(const TileArgs& a);
void host_dx_tile(const TileArgs& a);
void host_grpo_tokens(const GrpoArgs& a);
void host_dpo_pairs(const DpoArgs& a);

// Lanes the device block reduction uses; the host loops split a row the same way.
constexpr int kFoldThreads = 256;

}  // namespace fl
