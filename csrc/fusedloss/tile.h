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

template <typename T>
struct Vec {
  static constexpr int kSize = 16 / sizeof(T);
};

// 16 bytes at p (16-byte aligned) -> floats.
template <typename T>
FL_HD void load_group(const T* p, float* out) {
  constexpr int kN = Vec<T>::kSize;
#ifdef __CUDA_ARCH__
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
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

// Calls f(col, Count<n>, v, vt) for the lane's columns of one row: n == Vec<T>::kSize for a vector
// group starting at col, n == 1 for a single column. vt holds the teacher's values (xtr may be null).
template <typename T, typename F>
FL_HD void for_lane_groups(const T* xr, const T* xtr, int64_t cols, int64_t lane, int64_t nlanes, F&& f) {
  constexpr int kN = Vec<T>::kSize;
  float v[kN], vt[kN];
  for (int k = 0; k < kN; ++k) vt[k] = 0.0f;
  const uintptr_t ax = reinterpret_cast<uintptr_t>(xr);
  bool vec = ax % sizeof(T) == 0;
  if (xtr != nullptr && ((ax - reinterpret_cast<uintptr_t>(xtr)) & 15u) != 0) vec = false;
  int64_t prefix = vec ? int64_t(((16u - (ax & 15u)) & 15u) / sizeof(T)) : cols;
  if (prefix > cols) prefix = cols;
  const int64_t groups = (cols - prefix) / kN;
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

// n floats -> p (dtype TO); 16-byte stores when p is aligned and the group fills whole vectors.
template <typename TO, int kCount>
FL_HD void store_group(TO* p, const float* vals) {
  TO e[kCount];
  FL_UNROLL
  for (int k = 0; k < kCount; ++k) e[k] = from_float<TO>(vals[k]);
  constexpr int bytes = kCount * int(sizeof(TO));
  if (bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    FL_UNROLL
    for (int b = 0; b < bytes; b += 16) {
#ifdef __CUDA_ARCH__
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(p) + b) =
          *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(e) + b);
#else
      std::memcpy(reinterpret_cast<char*>(p) + b, reinterpret_cast<const char*>(e) + b, 16);
#endif
    }
  } else {
    FL_UNROLL
    for (int k = 0; k < kCount; ++k) p[k] = e[k];
  }
}

FL_HD bool row_ignored(const TileArgs& a, int64_t row) {
  return a.targets != 0 && reinterpret_cast<const int64_t*>(a.targets)[row] < 0;
}

FL_HD float bias_at(uint64_t bias, int dtype, int64_t v) {
  return bias != 0 ? load_as_float(reinterpret_cast<const void*>(bias), dtype, v) : 0.0f;
}

// ---- fold: one lane's partial statistics of one row ------------------------------------------------
template <typename T, bool kEntropy, bool kTeacher>
FL_HD RowState fold_lane(const TileArgs& a, int64_t row, int64_t lane, int64_t nlanes) {
  const T* xr = reinterpret_cast<const T*>(a.x) + row * a.ld;
  const T* xtr = kTeacher ? reinterpret_cast<const T*>(a.xt) + row * a.ld : nullptr;
  RowState st = empty_state();
  // is_top1 (first-argmax rule) needs the max over the columns before the target: tile column < ybefore.
  const int64_t ybefore =
      (a.want_extras && a.targets != 0) ? reinterpret_cast<const int64_t*>(a.targets)[row] - a.v0 : 0;
  for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float* v, const float* vt) {
    FL_UNROLL
    for (int k = 0; k < decltype(n)::value; ++k) {
      const int64_t col = a.v0 + c + k;
      const float z = transform_logit(v[k], bias_at(a.bias, a.bias_dtype, col), a.tf).z;
      float zt = 0.0f;
      if (kTeacher) zt = transform_logit(vt[k], bias_at(a.teacher_bias, a.teacher_bias_dtype, col), a.teacher_tf).z;
      state_add<kEntropy, kTeacher>(st, z, zt);
      if (c + k < ybefore) st.mb = fmaxf(st.mb, z);
    }
  });
  return st;
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
    if (y >= a.v0 && y < a.v0 + a.cols) {
      const float x = load_as_float(reinterpret_cast<const void*>(a.x), a.dtype, row * a.ld + (y - a.v0));
      zy = transform_logit(x, bias_at(a.bias, a.bias_dtype, y), a.tf).z;
    }
  }
  RowState run = part;
  if (!a.first) {
    RowState old;
    old.m = state[kM * ss + row];
    old.s = state[kS * ss + row];
    old.e = state[kE * ss + row];
    old.mt = state[kMt * ss + row];
    old.st = state[kSt * ss + row];
    old.a = state[kA * ss + row];
    old.b = state[kB * ss + row];
    old.s2 = state[kS2 * ss + row];
    old.sz = state[kSz * ss + row];
    old.mb = state[kMb * ss + row];
    old.t = state[kT * ss + row];
    run = state_merge<kEntropy, kTeacher>(old, part);
  }
  if (a.last) {
    float o[kNumOutputs];
    const Wants w{a.targets != 0, a.want_entropy, kTeacher, a.want_kl_rev, a.want_kl_fwd,
                  a.want_mean_logit, a.want_extras, float(a.vocab)};
    finalize_row(run, zy, w, o);
    for (int k = 0; k < kNumOutputs; ++k) out[k * os + row] = o[k];
  } else {
    state[kM * ss + row] = run.m;
    state[kS * ss + row] = run.s;
    state[kE * ss + row] = run.e;
    state[kMt * ss + row] = run.mt;
    state[kSt * ss + row] = run.st;
    state[kA * ss + row] = run.a;
    state[kB * ss + row] = run.b;
    state[kZy * ss + row] = zy;
    state[kS2 * ss + row] = run.s2;
    state[kSz * ss + row] = run.sz;
    state[kMb * ss + row] = run.mb;
    state[kT * ss + row] = run.t;
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
  const int64_t cs = a.coeff_stride;
  RowCoeffs r;
  r.a = k[row];
  r.c0 = k[cs + row];
  r.c1 = k[2 * cs + row];
  r.c2 = k[3 * cs + row];
  r.c3 = k[4 * cs + row];
  r.c4 = k[5 * cs + row];
  r.c5 = k[6 * cs + row];
  r.lse = out[kLse * a.out_stride + row];
  r.lse_t = out[kLseT * a.out_stride + row];
  r.lse_lo = out[kLseLo * a.out_stride + row];
  r.lse_t_lo = out[kLseTLo * a.out_stride + row];
  return r;
}

// A row whose gradient is identically zero: ignored, or all seven coefficients zero (masked tokens).
// Its saved lse is 0, so it must not be evaluated (exp(z - 0) may overflow, and inf * 0 is NaN).
FL_HD bool row_inactive(const TileArgs& a, int64_t row, const RowCoeffs& k) {
  return row_ignored(a, row) ||
         (k.a == 0.0f && k.c0 == 0.0f && k.c1 == 0.0f && k.c2 == 0.0f && k.c3 == 0.0f && k.c4 == 0.0f &&
          k.c5 == 0.0f);
}

template <typename T, typename TO, bool kTeacher>
FL_HD void dx_lane(const TileArgs& a, int64_t row, int64_t lane, int64_t nlanes) {
  const RowCoeffs k = row_coeffs(a, row);
  const T* xr = reinterpret_cast<const T*>(a.x) + row * a.ld;
  const T* xtr = kTeacher ? reinterpret_cast<const T*>(a.xt) + row * a.ld : nullptr;
  TO* dr = reinterpret_cast<TO*>(a.dx) + row * a.dx_ld;
  const bool inactive = row_inactive(a, row, k);
  const int64_t y = a.targets != 0 ? reinterpret_cast<const int64_t*>(a.targets)[row] - a.v0 : -1;
  for_lane_groups(xr, xtr, a.cols, lane, nlanes, [&](int64_t c, auto n, const float* v, const float* vt) {
    constexpr int kCount = decltype(n)::value;
    float g[kCount];
    FL_UNROLL
    for (int j = 0; j < kCount; ++j) {
      if (inactive) {
        g[j] = 0.0f;
        continue;
      }
      const int64_t col = a.v0 + c + j;
      const Logit z = transform_logit(v[j], bias_at(a.bias, a.bias_dtype, col), a.tf);
      float zt = 0.0f;
      if (kTeacher) zt = transform_logit(vt[j], bias_at(a.teacher_bias, a.teacher_bias_dtype, col), a.teacher_tf).z;
      const float dz = dz_element<kTeacher>(z.z, zt, c + j == y, k, a.has_jsd, a.jsd);
      g[j] = dz * chain_factor(z.c, a.tf);
    }
    store_group<TO, kCount>(dr + c, g);
  });
}

// ---- GRPO / DPO: one token (pair) of the per-token math, for the device kernels and the host loops ----
template <typename S>
FL_HD void grpo_element(const GrpoArgs& a, int64_t i) {
  auto at = [&](uint64_t p, S dflt) { return p ? reinterpret_cast<const S*>(p)[i] : dflt; };
  const S logp = at(a.logp, S(0));
  const S mask = at(a.mask, S(1));
  const bool ratio_given = a.logratio != 0;
  // Token level: log r = logp - old where the token counts, 0 elsewhere (garbage such as an old
  // log-prob of -inf on a padded position never reaches a sum), as grpo.py's token_log_ratio.
  const S logratio = ratio_given ? at(a.logratio, S(0)) : (mask != S(0) ? logp - at(a.old_logp, logp) : S(0));
  const GrpoToken<S> t = grpo_token<S>(logp, logratio, !ratio_given, at(a.adv, S(0)), mask, at(a.iw, S(1)),
                                       a.ref != 0, at(a.ref, S(0)), at(a.weight, S(1)), a.params);
  S* out = reinterpret_cast<S*>(a.out);
  const int64_t n = a.n;
  out[i] = t.loss;
  out[n + i] = t.dlogp;
  out[2 * n + i] = t.dlogratio;
  out[3 * n + i] = t.kl;
  out[4 * n + i] = t.is_low;
  out[5 * n + i] = t.is_high;
  out[6 * n + i] = t.is_region;
  out[7 * n + i] = t.ratio;
}

template <typename S>
FL_HD void dpo_element(const DpoArgs& a, int64_t i) {
  auto at = [&](uint64_t p, S dflt) { return p ? reinterpret_cast<const S*>(p)[i] : dflt; };
  const DpoPair<S> d = dpo_pair<S>(at(a.logp_c, S(0)), at(a.logp_r, S(0)), at(a.ref_c, S(0)), at(a.ref_r, S(0)),
                                   at(a.n_c, S(1)), at(a.n_r, S(1)), a.params);
  S* out = reinterpret_cast<S*>(a.out);
  out[i] = d.loss;
  out[a.n + i] = d.d_chosen;
  out[2 * a.n + i] = d.d_rejected;
}

}  // namespace fl
