// Row-level pieces of the three tile kernels (fold, jsd, dx), written once for the device kernels
// (kernels.cu) and the host loops (host.cpp).
//
// A row of a tile is split across `nlanes` lanes (threads of a block on the GPU, a loop on the host).
// Each lane walks its columns in 16-byte groups (4 fp32 or 8 bf16/fp16 values) with one vector load
// per group; the columns before the first 16-byte boundary of the row and after the last full group
// go one at a time, so any leading dimension and any vocabulary size (primes included) is read
// exactly, with no padded column ever entering a sum.
#pragma once

#include "args.h"
#include "math.h"

namespace fl {

// f(T{}) with T the storage type of a dtype code (validated by check.h): one switch for every launcher.
template <typename F>
void with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kBFloat16: f(bf16{}); break;
    case kFloat16: f(fp16{}); break;
    default: f(float{}); break;
  }
}

template <typename T>
struct Vec {
  static constexpr int kSize = 16 / sizeof(T);
};

// 16 bytes at p (16-byte aligned) -> floats. A streaming load (ld.global.cs): a tile is read once per
// pass, and the dx kernel may overwrite the very tile it reads (fp32 in place), which the read-only
// path (__ldg) does not allow.
template <typename T>
FL_HD void load_group(const T* p, float* out) {
  constexpr int kN = Vec<T>::kSize;
#ifdef __CUDA_ARCH__
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#else
  T e[kN];
  std::memcpy(e, p, 16);
#endif
FL_UNROLL
  for (int k = 0; k < kN; ++k) out[k] = to_float(e[k]);
}

// A compile-time count, so that per-group loops unroll and their arrays stay in registers.
template <int K>
struct Count {
  static constexpr int value = K;
};

// How a lane walks a row: `prefix` single columns up to the row's first 16-byte boundary (all of them
// when the student and teacher rows are not aligned alike), then `groups` vector groups of Vec<T>::kSize
// columns, then single columns to `cols`.
struct RowSplit {
  int64_t prefix, groups;
};

template <typename T>
FL_HD RowSplit row_split(const T* xr, const T* xtr, int64_t cols) {
  constexpr int kN = Vec<T>::kSize;
  const uintptr_t ax = reinterpret_cast<uintptr_t>(xr);
  bool vec = ax % sizeof(T) == 0;
  if (xtr != nullptr && ((ax - reinterpret_cast<uintptr_t>(xtr)) & 15u) != 0) vec = false;
  int64_t prefix = vec ? int64_t(((16u - (ax & 15u)) & 15u) / sizeof(T)) : cols;
  if (prefix > cols) prefix = cols;
  return RowSplit{prefix, (cols - prefix) / kN};
}

// Calls f(col, Count<n>, v, vt) for the lane's columns of one row: n == Vec<T>::kSize for a vector
// group starting at col, n == 1 for a single column. vt holds the teacher's values (xtr may be null).
template <typename T, typename F>
FL_HD void for_lane_groups(const T* xr, const T* xtr, int64_t cols, int64_t lane, int64_t nlanes, F&& f) {
  constexpr int kN = Vec<T>::kSize;
  float v[kN], vt[kN];
  for (int k = 0; k < kN; ++k) vt[k] = 0.0f;
  const RowSplit split = row_split(xr, xtr, cols);
  const int64_t prefix = split.prefix, groups = split.groups;
  for (int64_t c = lane; c < prefix; c += nlanes) {
    v[0] = to_float(xr[c]);
    if (xtr != nullptr) vt[0] = to_float(xtr[c]);
    f(c, Count<1>{}, v, vt);
  }
  for (int64_t g = lane; g < groups; g += nlanes) {
    const int64_t c = prefix + g * kN;
    load_group(xr + c, v);
    if (xtr != nullptr) load_group(xtr + c, vt);
    f(c, Count<kN>{}, v, vt);
  }
  for (int64_t c = prefix + groups * kN + lane; c < cols; c += nlanes) {
    v[0] = to_float(xr[c]);
    if (xtr != nullptr) vt[0] = to_float(xtr[c]);
    f(c, Count<1>{}, v, vt);
  }
}

// Two 16-bit values or one float as the 32-bit word they are stored as.
template <typename TO>
FL_HD uint32_t pack_word(const float* v) {
  if constexpr (sizeof(TO) == 4) {
    return float_to_bits(v[0]);
  } else {
    return uint32_t(from_float<TO>(v[0]).bits) | (uint32_t(from_float<TO>(v[1]).bits) << 16);
  }
}

// kCount floats -> p (dtype TO): 16-byte stores when the group fills whole 16-byte vectors and p is
// aligned, else 8-byte stores (4 bf16 from a 4-float group), else one value at a time. The words are
// built in registers and stored with the vector store intrinsics (streaming: the tile is read next by a
// product, from memory, not from the cache): a plain store of a uint4 is split by the compiler into
// 4-byte stores once it merges the aligned and unaligned branches.
template <typename TO, int kCount>
FL_HD void store_group(TO* p, const float* vals) {
  constexpr int kBytes = kCount * int(sizeof(TO));
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if constexpr (kBytes % 8 == 0) {
    constexpr int kWords = kBytes / 4, kPerWord = 4 / int(sizeof(TO));
    uint32_t w[kWords];
    FL_UNROLL
    for (int k = 0; k < kWords; ++k) w[k] = pack_word<TO>(vals + k * kPerWord);
    if (kBytes % 16 == 0 && (addr & 15u) == 0) {
      FL_UNROLL
      for (int k = 0; k < kWords; k += 4) {
#ifdef __CUDA_ARCH__
        __stcs(reinterpret_cast<uint4*>(p) + k / 4, make_uint4(w[k], w[k + 1], w[k + 2], w[k + 3]));
#else
        std::memcpy(reinterpret_cast<char*>(p) + 4 * k, w + k, 16);
#endif
      }
      return;
    }
    if ((addr & 7u) == 0) {
      FL_UNROLL
      for (int k = 0; k < kWords; k += 2) {
#ifdef __CUDA_ARCH__
        __stcs(reinterpret_cast<uint2*>(p) + k / 2, make_uint2(w[k], w[k + 1]));
#else
        std::memcpy(reinterpret_cast<char*>(p) + 4 * k, w + k, 8);
#endif
      }
      return;
    }
  }
  FL_UNROLL
  for (int k = 0; k < kCount; ++k) p[k] = from_float<TO>(vals[k]);
}

FL_HD bool row_ignored(const TileArgs& a, int64_t row) {
  return a.targets != 0 && reinterpret_cast<const int64_t*>(a.targets)[row] < 0;
}

FL_HD float bias_at(uint64_t bias, int dtype, int64_t v) {
  return bias != 0 ? load_as_float(reinterpret_cast<const void*>(bias), dtype, v) : 0.0f;
}

// The launch arguments with the transforms' reciprocals formed (in double, once per launch): every launcher,
// device and host, passes its arguments through this before the kernels read them.
inline TileArgs with_reciprocals(TileArgs a) {
  a.tf.inv_temperature = float(1.0 / double(a.tf.temperature));
  a.teacher_tf.inv_temperature = float(1.0 / double(a.teacher_tf.temperature));
  return a;
}

// Whether the tile's logits are the raw products themselves (no bias, identity transforms, the teacher's
// too): the kernels' kPlain instantiation. It forms the same values as the general path would (x + 0, times
// 1, times 1 / 1 are exact), so a forward and a backward may take either.
FL_HD bool plain_tile(const TileArgs& a) {
  return a.bias == 0 && a.teacher_bias == 0 && is_identity(a.tf) && (a.xt == 0 || is_identity(a.teacher_tf));
}

// ---- fold: one lane's partial statistics of one row ------------------------------------------------
template <typename T, bool kEntropy, bool kTeacher, bool kPlain>
FL_HD RowState fold_lane(const TileArgs& a, int64_t row, int64_t lane, int64_t nlanes) {
  const T* xr = reinterpret_cast<const T*>(a.x) + row * a.ld;
  const T* xtr = kTeacher ? reinterpret_cast<const T*>(a.xt) + row * a.ld : nullptr;
  RowState st = empty_state();
  // is_top1 (first-argmax rule) needs the max over the columns before the target: tile column < ybefore.
  const int64_t ybefore =
      (a.want_extras && a.targets != 0) ? reinterpret_cast<const int64_t*>(a.targets)[row] - a.v0 : 0;
  for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float* v, const float* vt) {
    constexpr int kN = decltype(n)::value;
    float z[kN], zt[kN];
    FL_UNROLL
    for (int k = 0; k < kN; ++k) {
      const int64_t col = a.v0 + c + k;
      z[k] = transform_logit<kPlain>(v[k], kPlain ? 0.0f : bias_at(a.bias, a.bias_dtype, col), a.tf).z;
      zt[k] = 0.0f;
      if (kTeacher) {
        zt[k] = transform_logit<kPlain>(
                    vt[k], kPlain ? 0.0f : bias_at(a.teacher_bias, a.teacher_bias_dtype, col), a.teacher_tf).z;
      }
      if (c + k < ybefore) st[kMb] = fmaxf(st[kMb], z[k]);
    }
    state_add_group<kEntropy, kTeacher, kN>(st, z, zt, float(a.v0 + c));
  });
  return st;
}

// The logit z of vocabulary column y (inside the tile) of a row, as the fold forms it.
FL_HD float logit_at(const TileArgs& a, int64_t row, int64_t y) {
  const float x = load_as_float(reinterpret_cast<const void*>(a.x), a.dtype, row * a.ld + (y - a.v0));
  return transform_logit(x, bias_at(a.bias, a.bias_dtype, y), a.tf).z;
}

// ---- fold: merge a row's tile partials into the running state; finalise on the last tile ------------
template <bool kEntropy, bool kTeacher>
FL_HD void fold_row_finish(const TileArgs& a, int64_t row, const RowState& part) {
  float* state = reinterpret_cast<float*>(a.state);
  const int64_t ss = a.state_stride;
  float* out = reinterpret_cast<float*>(a.out);
  const int64_t os = a.out_stride;
  if (row_ignored(a, row)) {
    if (a.last)
      for (int k = 0; k < kNumOutputs; ++k) out[k * os + row] = 0.0f;
    return;
  }
  float zy = a.first ? 0.0f : state[kZy * ss + row];
  if (a.targets != 0) {
    const int64_t y = reinterpret_cast<const int64_t*>(a.targets)[row];
    if (y >= a.v0 && y < a.v0 + a.cols) zy = logit_at(a, row, y);
  }
  // The named columns' logits, from the tile the statistics fold: z_k - m is then exact near the maximum.
  for (int64_t k = 0; k < a.num_columns; ++k) {
    const int64_t y = reinterpret_cast<const int64_t*>(a.columns)[row * a.num_columns + k];
    if (y >= a.v0 && y < a.v0 + a.cols) reinterpret_cast<float*>(a.column_logits)[row * a.num_columns + k] = logit_at(a, row, y);
  }
  RowState run = part;
  if (!a.first) {
    RowState old;
    FL_UNROLL
    for (int k = 0; k < kRowFields; ++k) old[k] = state[k * ss + row];
    run = state_merge<kEntropy, kTeacher>(old, part);
  }
  if (a.last) {
    float o[kNumOutputs];
    const Wants w{a.targets != 0, a.want_entropy, kTeacher, a.want_kl_rev, a.want_kl_fwd,
                  a.want_mean_logit, a.want_extras, float(a.vocab)};
    finalize_row(run, zy, w, o);
    for (int k = 0; k < kNumOutputs; ++k) out[k * os + row] = o[k];
  } else {
    FL_UNROLL
    for (int k = 0; k < kRowFields; ++k) state[k * ss + row] = run[k];
    state[kZy * ss + row] = zy;
  }
}

// ---- jsd: one lane's sums of q (log q - log m) and p (log p - log m) ------------------------------
template <typename T>
FL_HD void jsd_lane(const TileArgs& a, int64_t row, int64_t lane, int64_t nlanes, float& kl_qm, float& kl_pm) {
  const float* out = reinterpret_cast<const float*>(a.out);
  const float lse = out[kLse * a.out_stride + row];
  const float lse_t = out[kLseT * a.out_stride + row];
  const float lse_lo = out[kLseLo * a.out_stride + row];
  const float lse_t_lo = out[kLseTLo * a.out_stride + row];
  const T* xr = reinterpret_cast<const T*>(a.x) + row * a.ld;
  const T* xtr = reinterpret_cast<const T*>(a.xt) + row * a.ld;
  for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float* v, const float* vt) {
    FL_UNROLL
    for (int k = 0; k < decltype(n)::value; ++k) {
      const int64_t col = a.v0 + c + k;
      const float z = transform_logit(v[k], bias_at(a.bias, a.bias_dtype, col), a.tf).z;
      const float zt = transform_logit(vt[k], bias_at(a.teacher_bias, a.teacher_bias_dtype, col), a.teacher_tf).z;
      jsd_add((z - lse) - lse_lo, (zt - lse_t) - lse_t_lo, a.jsd, kl_qm, kl_pm);
    }
  });
}

FL_HD void jsd_row_finish(const TileArgs& a, int64_t row, float kl_qm, float kl_pm) {
  if (row_ignored(a, row)) return;
  float* acc = reinterpret_cast<float*>(a.jsd_acc);
  const int64_t as = a.jsd_acc_stride;
  if (!a.first) {
    kl_qm += acc[row];
    kl_pm += acc[as + row];
  }
  if (a.last) {
    float* out = reinterpret_cast<float*>(a.out);
    out[kKlQm * a.out_stride + row] = kl_qm;
    out[kJsd * a.out_stride + row] = jsd_value(kl_qm, kl_pm, a.jsd);
  } else {
    acc[row] = kl_qm;
    acc[as + row] = kl_pm;
  }
}

// ---- dx: one lane's columns of one row, raw product -> gradient of the raw product ------------------
FL_HD RowCoeffs row_coeffs(const TileArgs& a, int64_t row) {
  const float* k = reinterpret_cast<const float*>(a.coeffs);
  const float* out = reinterpret_cast<const float*>(a.out);
  RowCoeffs r;
  FL_UNROLL
  for (int c = 0; c < kNumCoeffs; ++c) r.c[c] = k[c * a.coeff_stride + row];
  r.lse = out[kLse * a.out_stride + row];
  r.lse_t = out[kLseT * a.out_stride + row];
  r.lse_lo = out[kLseLo * a.out_stride + row];
  r.lse_t_lo = out[kLseTLo * a.out_stride + row];
  r.row_max = out[kRowMax * a.out_stride + row];
  r.teacher_at_max = out[kTeacherAtMax * a.out_stride + row];
  r.kl_rev_rel = out[kKlRevRel * a.out_stride + row];
  return r;
}

FL_HD DzTerms dz_terms(const TileArgs& a) {
  const bool teacher = a.xt != 0;
  return DzTerms{a.want_entropy || (teacher && a.has_jsd), teacher && a.want_kl_rev,
                 teacher && a.want_kl_fwd, teacher && a.has_jsd, a.want_mean_logit};
}

// A row whose gradient is identically zero: ignored, or every coefficient zero (masked tokens; the same
// rule as the backend's _active_rows). Its saved lse may be 0, so it must not be evaluated (exp(z - 0) may
// overflow, and inf * 0 is NaN).
FL_HD bool row_inactive(const TileArgs& a, int64_t row, const RowCoeffs& k) {
  if (row_ignored(a, row)) return true;
  FL_UNROLL
  for (int c = 0; c < kNumCoeffs; ++c)
    if (k.c[c] != 0.0f) return false;
  return true;
}

// d loss / d x of kCount columns of a row from their raw products v (vt: the teacher's), stored at dr + c.
template <typename TO, bool kTeacher, bool kPlain, int kCount>
FL_HD void dx_group(const TileArgs& a, const RowCoeffs& k, const DzTerms& terms, int64_t y, TO* dr, int64_t c,
                    const float* v, const float* vt) {
  float g[kCount];
  FL_UNROLL
  for (int j = 0; j < kCount; ++j) {
    const int64_t col = a.v0 + c + j;
    const Logit z = transform_logit<kPlain>(v[j], kPlain ? 0.0f : bias_at(a.bias, a.bias_dtype, col), a.tf);
    float zt = 0.0f;
    if (kTeacher) {
      zt = transform_logit<kPlain>(vt[j], kPlain ? 0.0f : bias_at(a.teacher_bias, a.teacher_bias_dtype, col),
                                   a.teacher_tf).z;
    }
    const float dz = dz_element<kTeacher>(z.z, zt, c + j == y, k, terms, a.jsd);
    g[j] = dz * chain_factor<kPlain>(z.c, a.tf);
  }
  store_group<TO, kCount>(dr + c, g);
}

FL_HD int64_t target_column(const TileArgs& a, int64_t row) {
  return a.targets != 0 ? reinterpret_cast<const int64_t*>(a.targets)[row] - a.v0 : -1;
}

template <typename T, typename TO, bool kTeacher, bool kPlain>
FL_HD void dx_lane(const TileArgs& a, int64_t row, int64_t lane, int64_t nlanes) {
  const RowCoeffs k = row_coeffs(a, row);
  const DzTerms terms = dz_terms(a);
  const T* xr = reinterpret_cast<const T*>(a.x) + row * a.ld;
  const T* xtr = kTeacher ? reinterpret_cast<const T*>(a.xt) + row * a.ld : nullptr;
  TO* dr = reinterpret_cast<TO*>(a.dx) + row * a.dx_ld;
  if (row_inactive(a, row, k)) {  // exact zeros, nothing evaluated (a loop of its own: no test per column)
    for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float*, const float*) {
      constexpr int kCount = decltype(n)::value;
      float g[kCount];
      FL_UNROLL
      for (int j = 0; j < kCount; ++j) g[j] = 0.0f;
      store_group<TO, kCount>(dr + c, g);
    });
    return;
  }
  const int64_t y = target_column(a, row);
  for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float* v, const float* vt) {
    dx_group<TO, kTeacher, kPlain, decltype(n)::value>(a, k, terms, y, dr, c, v, vt);
  });
}

// ---- dx, packed: a half-precision gradient written over the fp32 tile it is computed from -------------
// (docs/design.md, "The logits workspace"). The tile viewed as 16-bit elements [rows, 2 * ld] holds dx(r, j)
// at element r * 2 * ld + j (dx_ld = 2 * ld, a.dx == a.x), so storing dx(r, j) overwrites bytes of fp32
// column j / 2 of the same row: columns that must have been read already. One block per row walks the row
// in rounds of contiguous, increasing column ranges: every lane loads its columns of the round (student and
// teacher) into registers, the block synchronises, then every lane stores the round's dx. A round's stores
// land in fp32 columns below ceil(end / 2) <= end, all read in this round (ordered by the barrier) or an
// earlier one, and no later round reads below its start >= end. Rows are disjoint (the same row base).
// `Lanes` runs the lanes of one block: each(f) calls f(lane, registers) for the lanes it runs (the calling
// thread on the device, all of them in order on the host), sync() is the block's barrier.
struct PackedLane {
  float v[4], vt[4];
};

// One round: lane l loads unit u0 + l (kCount columns from first + (u0 + l) * kCount) into its registers,
// the block synchronises, lane l stores that unit's dx. kFull: every lane has a unit (no bounds test).
template <typename TO, bool kTeacher, bool kPlain, int kCount, bool kFull, typename Lanes>
FL_HD void dx_packed_round(const TileArgs& a, const RowCoeffs& k, const DzTerms& terms, int64_t y,
                           const float* xr, const float* xtr, TO* dr, int64_t first, int64_t u0, int64_t units,
                           Lanes& lanes) {
  lanes.each([&](int64_t lane, PackedLane& r) {
    const int64_t u = u0 + lane;
    if (!kFull && u >= units) return;
    const int64_t c = first + u * kCount;
    if constexpr (kCount == 1) {
      r.v[0] = xr[c];
      if (kTeacher) r.vt[0] = xtr[c];
    } else {
      load_group(xr + c, r.v);
      if (kTeacher) load_group(xtr + c, r.vt);
    }
  });
  lanes.sync();
  lanes.each([&](int64_t lane, PackedLane& r) {
    const int64_t u = u0 + lane;
    if (kFull || u < units) dx_group<TO, kTeacher, kPlain, kCount>(a, k, terms, y, dr, first + u * kCount, r.v, r.vt);
  });
}

// The rounds over `units` units of kCount columns starting at column `first`: full ones, then the rest.
// The loop bounds are the block's, so every lane reaches every sync().
template <typename TO, bool kTeacher, bool kPlain, int kCount, typename Lanes>
FL_HD void dx_packed_rounds(const TileArgs& a, const RowCoeffs& k, const DzTerms& terms, int64_t y,
                            const float* xr, const float* xtr, TO* dr, int64_t first, int64_t units,
                            Lanes& lanes) {
  const int64_t nlanes = lanes.count();
  int64_t u0 = 0;
  for (; u0 + nlanes <= units; u0 += nlanes)
    dx_packed_round<TO, kTeacher, kPlain, kCount, true>(a, k, terms, y, xr, xtr, dr, first, u0, units, lanes);
  if (u0 < units)
    dx_packed_round<TO, kTeacher, kPlain, kCount, false>(a, k, terms, y, xr, xtr, dr, first, u0, units, lanes);
}

template <typename TO, bool kTeacher, bool kPlain, typename Lanes>
FL_HD void dx_packed_row(const TileArgs& a, int64_t row, Lanes& lanes) {
  static_assert(sizeof(TO) == 2, "packed dx holds 16-bit values");
  const RowCoeffs k = row_coeffs(a, row);
  const float* xr = reinterpret_cast<const float*>(a.x) + row * a.ld;
  const float* xtr = kTeacher ? reinterpret_cast<const float*>(a.xt) + row * a.ld : nullptr;
  TO* dr = reinterpret_cast<TO*>(a.dx) + row * a.dx_ld;
  const int64_t nlanes = lanes.count();
  if (row_inactive(a, row, k)) {  // exact zeros; nothing is read, so nothing needs ordering
    constexpr int kZ = 8;  // 16 bytes of 16-bit zeros
    lanes.each([&](int64_t lane, PackedLane&) {
      const float zeros[kZ] = {};
      for (int64_t c = lane * kZ; c < a.cols; c += nlanes * kZ) {
        if (c + kZ <= a.cols) {
          store_group<TO, kZ>(dr + c, zeros);
        } else {
          for (int64_t j = c; j < a.cols; ++j) store_group<TO, 1>(dr + j, zeros);
        }
      }
    });
    return;
  }
  const DzTerms terms = dz_terms(a);
  const int64_t y = target_column(a, row);
  const RowSplit split = row_split(xr, xtr, a.cols);
  constexpr int kN = Vec<float>::kSize;
  const int64_t tail = split.prefix + split.groups * kN;
  dx_packed_rounds<TO, kTeacher, kPlain, 1>(a, k, terms, y, xr, xtr, dr, 0, split.prefix, lanes);
  dx_packed_rounds<TO, kTeacher, kPlain, kN>(a, k, terms, y, xr, xtr, dr, split.prefix, split.groups, lanes);
  dx_packed_rounds<TO, kTeacher, kPlain, 1>(a, k, terms, y, xr, xtr, dr, tail, a.cols - tail, lanes);
}

// Whether a dx launch packs its gradient into the tile (validated by check.h).
FL_HD bool packed_dx(const TileArgs& a) { return a.dx == a.x && a.dx_dtype != a.dtype; }

}  // namespace fl
