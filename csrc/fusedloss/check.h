// Validation of TileArgs at the C++ boundary, for the device launchers and the host loops alike: a bad
// argument is a std::invalid_argument (a ValueError in Python) with a sentence that names the field and
// the value, never an out-of-bounds access. Host code only.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "args.h"

namespace fl {
namespace check_detail {

inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& s, const T& v, const Rest&... rest) {
  s << v;
  append(s, rest...);
}

template <typename... Parts>
[[noreturn]] void fail(const char* kernel, const Parts&... parts) {
  std::ostringstream s;
  s << "fusedloss " << kernel << ": ";
  append(s, parts...);
  throw std::invalid_argument(s.str());
}

}  // namespace check_detail

// FL_CHECK(condition, sentence parts...): the parts are streamed into the message.
#define FL_CHECK(cond, ...)                                                \
  do {                                                                     \
    if (!(cond)) ::fl::check_detail::fail(kernel, __VA_ARGS__);            \
  } while (0)
// A pointer field that must be set.
#define FL_CHECK_PTR(args, field, why) \
  FL_CHECK((args).field != 0, "the pointer `" #field "` is null; ", why)
// A per-row array whose rows are `stride` apart must hold the tile's rows.
#define FL_CHECK_STRIDE(args, field) \
  FL_CHECK((args).field >= (args).rows, "`" #field "` = ", (args).field, " is smaller than the tile's rows = ", (args).rows)
// A dtype code of fl::DType.
#define FL_CHECK_DTYPE(args, field)                                                                  \
  FL_CHECK((args).field >= 0 && (args).field < kNumDTypes, "`" #field "` = ", (args).field,        \
           " is not a dtype code (0 float32, 1 bfloat16, 2 float16)")

enum class Kernel { kFold, kJsd, kDx };

inline void check_transform(const char* kernel, const Transform& t, const char* which) {
  FL_CHECK(t.temperature > 0.0f && t.temperature - t.temperature == 0.0f, "the ", which,
           " temperature must be positive and finite, got ", t.temperature);
  FL_CHECK(t.softcap >= 0.0f, "the ", which, " softcap must be >= 0 (0: none), got ", t.softcap);
}

inline void validate(const TileArgs& a, Kernel k) {
  const char* kernel = k == Kernel::kFold ? "fold_tile" : k == Kernel::kJsd ? "jsd_tile" : "dx_tile";
  FL_CHECK(a.rows >= 0 && a.cols >= 0, "the tile shape must not be negative, got rows = ", a.rows,
           ", cols = ", a.cols);
  FL_CHECK(a.rows <= 2147483647LL, "a tile holds at most 2^31 - 1 rows (one block per row), got ", a.rows);
  FL_CHECK_DTYPE(a, dtype);
  FL_CHECK_PTR(a, x, "the raw-product tile is required");
  FL_CHECK(a.ld >= a.cols, "the leading dimension ld = ", a.ld, " is smaller than the tile's cols = ", a.cols);
  FL_CHECK(a.v0 >= 0 && a.v0 + a.cols <= a.vocab, "the tile's columns [v0, v0 + cols) = [", a.v0, ", ",
           a.v0 + a.cols, ") must lie inside the vocabulary [0, vocab = ", a.vocab, ")");
  FL_CHECK_PTR(a, out, "the per-row statistics are written (fold) or read (jsd, dx) there");
  FL_CHECK_STRIDE(a, out_stride);
  if (a.bias != 0) FL_CHECK_DTYPE(a, bias_dtype);
  if (a.teacher_bias != 0) FL_CHECK_DTYPE(a, teacher_bias_dtype);
  check_transform(kernel, a.tf, "student");
  FL_CHECK(a.device >= 0, "`device` must be a CUDA device index, got ", a.device);
  const bool teacher_terms = a.want_kl_rev || a.want_kl_fwd || a.has_jsd;
  if (teacher_terms || a.xt != 0) {
    FL_CHECK_PTR(a, xt, "a KL or JSD term needs the teacher's tile");
    check_transform(kernel, a.teacher_tf, "teacher");
  }
  if (a.has_jsd)
    FL_CHECK(a.jsd.beta > 0.0f && a.jsd.beta < 1.0f, "the JSD beta must lie strictly between 0 and 1, got ",
             a.jsd.beta);
  const bool several_tiles = !a.first || !a.last;
  switch (k) {
    case Kernel::kFold:
      if (a.num_columns != 0) {
        FL_CHECK(a.num_columns > 0, "`num_columns` must not be negative, got ", a.num_columns);
        FL_CHECK_PTR(a, columns, "the named columns' ids are read there (num_columns > 0)");
        FL_CHECK_PTR(a, column_logits, "the named columns' logits are written there (num_columns > 0)");
      }
      if (several_tiles) {
        FL_CHECK_PTR(a, state, "a fold over several vocabulary tiles keeps its running state there");
        FL_CHECK_STRIDE(a, state_stride);
      }
      break;
    case Kernel::kJsd:
      FL_CHECK(a.has_jsd, "jsd_tile needs has_jsd (the JSD's beta)");
      if (several_tiles) {
        FL_CHECK_PTR(a, jsd_acc, "a JSD sweep over several vocabulary tiles keeps its sums there");
        FL_CHECK_STRIDE(a, jsd_acc_stride);
      }
      break;
    case Kernel::kDx:
      FL_CHECK_PTR(a, coeffs, "the per-row gradient coefficients are read there");
      FL_CHECK_STRIDE(a, coeff_stride);
      FL_CHECK_PTR(a, dx, "the gradient tile is written there");
      FL_CHECK_DTYPE(a, dx_dtype);
      FL_CHECK(a.dx_ld >= a.cols, "the gradient tile's leading dimension dx_ld = ", a.dx_ld,
               " is smaller than the tile's cols = ", a.cols);
      if (a.dx == a.x) {
        const bool in_place = a.dx_dtype == a.dtype && a.dx_ld == a.ld;
        const bool packed = a.dtype == kFloat32 && a.dx_dtype != kFloat32 && a.dx_ld == 2 * a.ld;
        FL_CHECK(in_place || packed,
                 "a gradient written over the tile must keep its dtype and leading dimension (in place), or pack "
                 "bf16/fp16 values over an fp32 tile with dx_ld = 2 * ld; got dtype ", a.dtype, ", dx_dtype ",
                 a.dx_dtype, ", ld ", a.ld, ", dx_ld ", a.dx_ld);
      }
      break;
  }
}

}  // namespace fl
