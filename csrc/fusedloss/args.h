// Launch arguments of the tile kernels, shared by the device launchers (kernels.cu), the host loops
// (host.cpp) and the Python bindings (bindings.cpp). Plain C++: no CUDA or torch header, so the bindings
// compile with the host compiler and the extension does not depend on the torch C++ ABI.
//
// Pointers travel as integers (tensor.data_ptr() on the Python side); dtypes as fl::DType codes.
// A row r of a tile lives at x + r * ld (elements). Per-row arrays (targets, state, outputs, coefficients)
// are already offset to the first row of the tile by the caller; `*_stride` is the distance between
// consecutive fields of the same row (e.g. N for the [13, N] output tensor).
#pragma once

#include <cstdint>

#include "math.h"

namespace fl {

// The running-state buffer of a fold over several vocabulary tiles: float [kStateFields, state_stride],
// the RowState fields, then the target logit zy.
constexpr int kZy = kRowFields;
constexpr int kStateFields = kRowFields + 1;

// The fields of TileArgs, written once: the struct below and the Python bindings are generated from it.
#define FL_TILE_ARGS(X)                                                                                     \
  /* Student and (optional) teacher raw products x = h @ W.T for `rows` rows and vocabulary columns      \
     [v0, v0 + cols); same dtype and leading dimension for both. */                                       \
  X(uint64_t, x, 0) X(uint64_t, xt, 0) X(int, dtype, kFloat32) X(int64_t, ld, 0)                          \
  X(int64_t, rows, 0) X(int64_t, cols, 0) X(int64_t, v0, 0)                                               \
  /* [V] biases (indexed by v0 + col), 0 when absent, and the logit transforms */                         \
  X(uint64_t, bias, 0) X(uint64_t, teacher_bias, 0) X(int, bias_dtype, kFloat32)                          \
  X(int, teacher_bias_dtype, kFloat32) X(Transform, tf, Transform()) X(Transform, teacher_tf, Transform()) \
  /* int64 [rows], -1 = ignored row; 0 = no targets (every row valid) */                                  \
  X(uint64_t, targets, 0)                                                                                 \
  /* named columns (fusedloss/core/columns.py): int64 [rows, num_columns] vocabulary ids, -1 = none; the  \
     fold writes the logits at those inside its tile to float column_logits [rows, num_columns] */        \
  X(uint64_t, columns, 0) X(int64_t, num_columns, 0) X(uint64_t, column_logits, 0)                        \
  /* what the problem asks for */                                                                         \
  X(bool, want_entropy, false) X(bool, want_kl_rev, false) X(bool, want_kl_fwd, false)                    \
  X(bool, want_mean_logit, false) X(bool, want_extras, false)                                             \
  X(int64_t, vocab, 0) /* V: mean_logit = sum z / V, and the bound of [v0, v0 + cols) */                  \
  X(bool, first, true) X(bool, last, true) /* first vocabulary tile (initialise), last (finalise) */      \
  /* running state float [kStateFields, state_stride] of a fold over several tiles */                     \
  X(uint64_t, state, 0) X(int64_t, state_stride, 0)                                                       \
  /* outputs float [kNumOutputs, out_stride], written on the last tile (zeros on ignored rows); the      \
     gradient pass reads lse, lse_lo, lse_t, lse_t_lo from them */                                        \
  X(uint64_t, out, 0) X(int64_t, out_stride, 0)                                                           \
  /* JSD second pass: beta in (0, 1); accumulators float [2, jsd_acc_stride] (kl_qm, kl_pm) */            \
  X(JsdConsts, jsd, JsdConsts()) X(bool, has_jsd, false) X(uint64_t, jsd_acc, 0)                          \
  X(int64_t, jsd_acc_stride, 0)                                                                           \
  /* gradient: coefficients float [kNumCoeffs, coeff_stride]; dx output tile, which may alias x: in     \
     place (x's dtype and ld), or packed (16-bit dx over an fp32 x, dx_ld = 2 * ld; tile.h) */            \
  X(uint64_t, coeffs, 0) X(int64_t, coeff_stride, 0) X(uint64_t, dx, 0) X(int, dx_dtype, kFloat32)        \
  X(int64_t, dx_ld, 0)                                                                                    \
  X(int, device, 0) /* the CUDA device the pointers live on (restored after the launch) */

struct TileArgs {
#define FL_TILE_FIELD(type, name, init) type name = init;
  FL_TILE_ARGS(FL_TILE_FIELD)
#undef FL_TILE_FIELD
};

// Device launchers (kernels.cu); `stream` is a cudaStream_t as an integer. They validate their arguments
// (check.h), run under `a.device` and restore the caller's current device. Throw std::invalid_argument
// on bad arguments and std::runtime_error on CUDA errors.
void fold_tile(const TileArgs& a, uint64_t stream);
void jsd_tile(const TileArgs& a, uint64_t stream);
void dx_tile(const TileArgs& a, uint64_t stream);

// What the extension's own (statically linked) CUDA runtime sees: availability() asks these rather than
// torch, whose runtime may accept a driver that this one does not.
int cuda_device_count();           // 0 when no device or driver is usable
const char* cuda_device_error();   // why cudaGetDeviceCount failed ("" when it did not)
int cuda_runtime_version();        // e.g. 13000 for CUDA 13.0 (cudaRuntimeGetVersion)
int cuda_driver_version();         // the CUDA version the driver supports, 0 without a driver

// Host loops over CPU pointers (host.cpp): the same math, for tests without a GPU.
void host_fold_tile(const TileArgs& a);
void host_jsd_tile(const TileArgs& a);
void host_dx_tile(const TileArgs& a);

// Lanes the device block reduction uses; the host loops split a row the same way.
constexpr int kFoldThreads = 256;
// Threads of a dx block; the host loop of packed dx runs a row's rounds with as many lanes.
constexpr int kDxThreads = 256;

}  // namespace fl
