// Per-element and per-row math of the statistics core (docs/design.md, "The statistics problem" and
// "The dz formula"; fusedloss/core/problem.py).
//
// Everything here is `FL_HD`: compiled for the device kernels (kernels.cu) AND for the host loops
// (host.cpp), so the CPU test suite checks the very functions the GPU runs. Names mirror the Python:
// the outputs lse, logp, entropy, kl_rev, kl_fwd, jsd, lse_t, kl_qm, the coefficients a, c0..c5, and the
// partial statistics (m, s, e, mt, st, a, b, ...) of fusedloss/backends/torch.py.
//
// The math is fp32. Sums are kept relative to the running maxima (m for the student, mt for the teacher)
// so that peaked rows with logits near 1e4 keep the digits of their entropy and KL; log s is formed as
// log1p(s - 1) and the normaliser carries its rounding residual (lse_lo), so confident rows keep the
// digits of 1 - q_y.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FL_HD __host__ __device__ __forceinline__
#else
#define FL_HD inline
#endif
// Unrolling hints for the device pass only (the host compiler would warn about an unknown pragma).
#ifdef __CUDA_ARCH__
#define FL_UNROLL _Pragma("unroll")
#else
#define FL_UNROLL
#endif

namespace fl {

// ---------------------------------------------------------------------------------------------------
// Storage types. bf16/fp16 are carried as raw 16-bit words so that the same code compiles without the
// CUDA headers; the conversions round to nearest even exactly like __float2bfloat16_rn/__float2half_rn.
// ---------------------------------------------------------------------------------------------------
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNumDTypes };

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

FL_HD float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

FL_HD uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FL_HD float to_float(float v) { return v; }
FL_HD float to_float(bf16 v) { return bits_to_float(uint32_t(v.bits) << 16); }
FL_HD float to_float(fp16 v) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(v.bits));
#else
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu;
  const uint32_t mant = v.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = float(mant) * 5.9604644775390625e-08f;
    return bits_to_float(sign | float_to_bits(mag));
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

template <typename T> FL_HD T from_float(float v);
template <> FL_HD float from_float<float>(float v) { return v; }
template <> FL_HD bf16 from_float<bf16>(float v) {
#ifdef __CUDA_ARCH__
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
#else
  const uint32_t u = float_to_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};  // quiet nan
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
#endif
}
template <> FL_HD fp16 from_float<fp16>(float v) {
#ifdef __CUDA_ARCH__
  return fp16{__half_as_ushort(__float2half_rn(v))};
#else
  const uint32_t u = float_to_bits(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};  // nan
  if (ax >= 0x47800000u) return fp16{uint16_t(sign | 0x7c00u)};  // >= 65536 (and inf): inf
  if (ax < 0x38800000u) {  // below the smallest normal half: subnormal, multiple of 2^-24
    const float scaled = bits_to_float(ax) * 16777216.0f;  // exact (power-of-two scaling)
    return fp16{uint16_t(sign | uint32_t(std::nearbyint(scaled)))};
  }
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // round to nearest even on bit 13
  return fp16{uint16_t(sign | ((rounded - 0x38000000u) >> 13))};
#endif
}

FL_HD float load_as_float(const void* p, int dtype, int64_t i) {
  if (dtype == kBFloat16) return to_float(static_cast<const bf16*>(p)[i]);
  if (dtype == kFloat16) return to_float(static_cast<const fp16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

FL_HD float fl_inf() { return bits_to_float(0x7f800000u); }

// ---------------------------------------------------------------------------------------------------
// Logits: z = softcap(logit_scale * (x + b)) / temperature, in the same operation order
// as fusedloss/backends/torch.py::_transform.
// ---------------------------------------------------------------------------------------------------
struct Transform {
  float logit_scale = 1.0f;
  float softcap = 0.0f;  // <= 0: no soft-cap
  float temperature = 1.0f;
  float chain = 1.0f;    // logit_scale / temperature, formed in double on the host
  float inv_temperature = 1.0f;  // 1 / temperature, formed in double by the launchers (with_reciprocals)
};

// The identity transform (logit_scale 1, no soft-cap, temperature 1) of a tile without biases: z = x and
// d z / d x = 1. The kernels have an instantiation for it (kPlain) that forms nothing per element.
FL_HD bool is_identity(const Transform& t) {
  return t.logit_scale == 1.0f && !(t.softcap > 0.0f) && t.temperature == 1.0f;
}

struct Logit {
  float z;  // the transformed logit
  float c;  // the soft-capped value (the chain rule needs it)
};

// z = c * (1 / T): a multiply by the launcher's reciprocal, not a division per element (an IEEE division
// is a reciprocal, a Newton step and a slow-path test). Forward and backward form z the same way.
template <bool kPlain = false>
FL_HD Logit transform_logit(float x, float bias, const Transform& t) {
  if (kPlain) return Logit{x, x};
  const float u = (x + bias) * t.logit_scale;
  const float c = t.softcap > 0.0f ? t.softcap * tanhf(u / t.softcap) : u;
  return Logit{c * t.inv_temperature, c};
}

// d z / d x, elementwise: (logit_scale / temperature) * (1 - (c / softcap)^2).
template <bool kPlain = false>
FL_HD float chain_factor(float c, const Transform& t) {
  if (kPlain) return 1.0f;
  if (t.softcap > 0.0f) {
    const float r = c / t.softcap;
    return t.chain * (1.0f - r * r);
  }
  return t.chain;
}

// e^x as one multiply by log2(e) and the hardware's base-2 exponential on the device (MUFU.EX2 through
// ex2.approx.ftz: ~2 ulp, results below 2^-126 flush to 0, which no sum here can see), where expf's accurate
// range reduction costs ~8 instructions; exp2f on the host twins. -inf gives 0, NaN stays NaN. Used for the
// terms of the sums and of dz; the normalisers' logs and the tile merges keep the accurate functions.
constexpr float kLog2e = 1.44269504088896340736f;
FL_HD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
#else
  return std::exp2(x * kLog2e);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Partial statistics of a set of vocabulary columns for one row (fusedloss/core/partials.py docstring):
//   s = sum e^(z-m)   e = sum e^(z-m)(z-m)   st = sum e^(zt-mt)
//   ztm = zt at the student's maximum column (the first one the fold met)
//   a = sum e^(z-m)((z-m)-(zt-ztm))          b = sum e^(zt-mt)((zt-mt)-(z-m))
//       a is relative to the student's maximum column, whose own term is exactly 0: a confident student's
//       a / s (kl_rev_rel) stays small and exact however far the teacher is (core/partials.py)
//   s2 = sum e^(2(z-m))  (log sum q^2 = log s2 - 2 log s, TRL's log_sum_sq_probs)
//   sz = sum z           (mean_logit = sz / V; needs no maximum)
//   mb = max of z over the columns before the target (is_top1's first-argmax rule); -inf if none
//   t  = s - 1: the sum without the maximum column's own e^0 = 1, so that log s = log1p(t) keeps the
//        digits of a confident row (s = 1 + 1e-3 in fp32 would hold t to 1e-4 relative only)
// An array indexed by named fields, so that the block reduction, the state buffer's loads and stores and
// the host twins walk the fields in one loop each instead of naming every field again.
// ---------------------------------------------------------------------------------------------------
// kCol: the vocabulary column of the (first) maximum, as a float (exact below 2^24 columns), so that every
// merge tree (warp shuffles, the host twins' halving tree, tiles in order) takes z_t at the same column: ties
// go to the lower column, as torch's argmax and the Triton fold.
enum RowField : int { kM = 0, kS, kE, kMt, kSt, kA, kB, kS2, kSz, kMb, kT, kZtm, kCol, kRowFields };

struct RowState {
  float v[kRowFields];
  FL_HD float& operator[](int k) { return v[k]; }
  FL_HD float operator[](int k) const { return v[k]; }
};

// Whether a field carries information for a fold with (kEntropy, kTeacher): the others are neither
// reduced nor merged.
template <bool kEntropy, bool kTeacher>
FL_HD constexpr bool field_used(int k) {
  return k == kE ? kEntropy
         : (k == kMt || k == kSt || k == kA || k == kB || k == kZtm || k == kCol) ? kTeacher
                                                                                 : true;
}

FL_HD bool is_max_field(int k) { return k == kM || k == kMt || k == kMb; }

FL_HD RowState empty_state() {
  RowState r;
  FL_UNROLL
  for (int k = 0; k < kRowFields; ++k) r[k] = is_max_field(k) ? -fl_inf() : 0.0f;
  return r;
}

// x * y, taken as 0 when x == 0 (a probability that underflowed, times a log-ratio that may be -inf).
FL_HD float xmul(float x, float y) { return x != 0.0f ? x * y : 0.0f; }

FL_HD bool is_finite(float x) { return x - x == 0.0f; }  // x - x is NaN for inf and NaN

// One column of a KL partial (a: own = student; b: own = teacher), e^(own - own max) times the log-ratio
// `ratio` of the two sides in their frames: 0 where the own logit is -inf (0 log 0), +inf where it is finite
// and the other side's is -inf (mass where the other has none), whatever exp underflows to at the current
// scale. So the KL does not depend on how the vocabulary was cut into lanes, tiles or ranks
// (backends/torch.py::_kl_terms, docs/design.md "Numerical doctrine").
FL_HD float kl_term(float e_own, float ratio, float own, float other) {
  return (is_finite(own) && other == -fl_inf()) ? fl_inf() : xmul(e_own, ratio);
}

// A KL partial rebased to a new maximum: +inf stays +inf whatever the factor (0 * inf would be NaN where
// the old maximum underflows against the new one), as core/partials.py::_keep_inf.
FL_HD float keep_inf(float part, float rebased) { return part == fl_inf() ? part : rebased; }

// One column of a (the reverse KL's partial, relative to the student's maximum column where zt = ztm): rule
// G, and +inf outright where ztm is -inf (the maximum column has mass the teacher lacks: KL(q||p) = +inf
// whatever the other columns give), as core/partials.py::reverse_kl_infinite.
FL_HD float rev_kl_term(float ez, float d, float z, float zt, float ztm) {
  return (is_finite(z) && (zt == -fl_inf() || ztm == -fl_inf())) ? fl_inf() : xmul(ez, d - (zt - ztm));
}

// z - m for a column of a row whose running maximum is m: -inf for a masked column (z = -inf) even when
// no finite column came yet (m = -inf too), so that a masked student column against a teacher's mass
// gives KL(p || q) = +inf, never -inf - -inf = NaN (and likewise for the teacher side).
FL_HD float shifted(float z, float m) { return z == -fl_inf() ? z : z - m; }

// Fold a group of kN columns (z[k], zt[k]; the first at vocabulary column col0) into the running state. The
// maxima move once per group, to the group's maximum (its first column on ties), and only when it exceeds
// the running one, so a column costs one exponential per side and no branch. -inf logits contribute nothing
// to the sums; NaN never becomes a maximum and propagates through the sums; +inf propagates.
template <bool kEntropy, bool kTeacher, int kN>
FL_HD void state_add_group(RowState& r, const float* z, const float* zt, float col0) {
  float gmax = -fl_inf(), gzt = 0.0f;
  int kmax = -1;
  FL_UNROLL
  for (int k = 0; k < kN; ++k) {
    if (z[k] > gmax) {
      gmax = z[k];
      gzt = kTeacher ? zt[k] : 0.0f;
      kmax = k;
    }
  }
  const bool grow = gmax > r[kM];
  if (grow) {
    if (r[kM] != -fl_inf()) {
      const float dm = r[kM] - gmax;
      const float f = fast_exp(dm);
      if (kEntropy) r[kE] = f * (r[kE] + r[kS] * dm);
      if (kTeacher) {
        // a moves to the new maximum column's frame (z, zt): shift (old m - z) - (old ztm - zt).
        r[kA] = gzt == -fl_inf() ? fl_inf() : keep_inf(r[kA], f * (r[kA] + r[kS] * (dm - (r[kZtm] - gzt))));
        r[kB] = r[kB] - r[kSt] * dm;
      }
      r[kS] *= f;
      r[kS2] *= f * f;
      r[kT] = (r[kT] + 1.0f) * f;  // the old maximum column now contributes f
    }
    r[kM] = gmax;
    if (kTeacher) {
      r[kZtm] = gzt;
      r[kCol] = col0 + float(kmax);
    }
  }
  if (kTeacher) {
    float gtmax = -fl_inf();
    FL_UNROLL
    for (int k = 0; k < kN; ++k) gtmax = zt[k] > gtmax ? zt[k] : gtmax;
    if (gtmax > r[kMt]) {
      if (r[kMt] != -fl_inf()) {
        const float dmt = r[kMt] - gtmax;
        const float g = fast_exp(dmt);
        r[kB] = keep_inf(r[kB], g * (r[kB] + r[kSt] * dmt));
        r[kSt] *= g;
      }
      r[kMt] = gtmax;
    }
  }
  FL_UNROLL
  for (int k = 0; k < kN; ++k) {
    const float d = shifted(z[k], r[kM]);
    const float ez = z[k] == -fl_inf() ? 0.0f : fast_exp(d);
    r[kS] += ez;
    r[kT] += (grow && k == kmax) ? 0.0f : ez;  // the new maximum column contributes the implicit 1
    r[kS2] += ez * ez;
    r[kSz] += z[k];
    if (kEntropy) r[kE] += xmul(ez, d);
    if (kTeacher) {
      const float dt = shifted(zt[k], r[kMt]);
      const float ezt = zt[k] == -fl_inf() ? 0.0f : fast_exp(dt);
      r[kSt] += ezt;
      r[kA] += rev_kl_term(ez, d, z[k], zt[k], r[kZtm]);
      r[kB] += kl_term(ezt, dt - d, zt[k], z[k]);
    }
  }
}

// exp(old - new) and (old - new), with an empty side (old == -inf) contributing factor 0 and shift 0.
FL_HD void rescale_factor(float old_max, float new_max, float& f, float& d) {
  if (old_max == -fl_inf()) {
    f = 0.0f;
    d = 0.0f;
  } else {
    d = old_max - new_max;
    f = expf(d);
  }
}

// The associative merge (fusedloss/core/partials.py::merge): used by the block reductions and by the fold of
// a tile's partials into the running state of the previous tiles. Unused fields keep r's value.
template <bool kEntropy, bool kTeacher>
FL_HD RowState state_merge(const RowState& r, const RowState& p) {
  RowState o = r;
  o[kM] = fmaxf(r[kM], p[kM]);
  float fr, dr, fp, dp;
  rescale_factor(r[kM], o[kM], fr, dr);
  rescale_factor(p[kM], o[kM], fp, dp);
  o[kS] = fr * r[kS] + fp * p[kS];
  o[kS2] = fr * fr * r[kS2] + fp * fp * p[kS2];
  // t: the side holding the maximum keeps its t; the other adds all of its columns (1 + t), rescaled.
  o[kT] = r[kM] >= p[kM] ? r[kT] + fp * (1.0f + p[kT]) : p[kT] + fr * (1.0f + r[kT]);
  o[kSz] = r[kSz] + p[kSz];
  o[kMb] = fmaxf(r[kMb], p[kMb]);
  if (kEntropy) o[kE] = fr * (r[kE] + r[kS] * dr) + fp * (p[kE] + p[kS] * dp);
  if (kTeacher) {
    o[kMt] = fmaxf(r[kMt], p[kMt]);
    float gr, drt, gp, dpt;
    rescale_factor(r[kMt], o[kMt], gr, drt);
    rescale_factor(p[kMt], o[kMt], gp, dpt);
    o[kSt] = gr * r[kSt] + gp * p[kSt];
    o[kB] = keep_inf(r[kB], gr * (r[kB] + r[kSt] * (drt - dr))) + keep_inf(p[kB], gp * (p[kB] + p[kSt] * (dpt - dp)));
    // a: the side holding the (first) maximum keeps its a and its frame exactly; the other side's a moves
    // into that frame (nothing from an empty side). Scalars, not references to r or p: a selected reference
    // would put both states in local memory around the warp shuffles.
    const bool r_holds = r[kM] > p[kM] || (r[kM] == p[kM] && r[kCol] <= p[kCol]);
    const float h_a = r_holds ? r[kA] : p[kA], h_ztm = r_holds ? r[kZtm] : p[kZtm];
    const float x_m = r_holds ? p[kM] : r[kM], x_a = r_holds ? p[kA] : r[kA];
    const float x_s = r_holds ? p[kS] : r[kS], x_ztm = r_holds ? p[kZtm] : r[kZtm];
    const float fx = r_holds ? fp : fr, dx = r_holds ? dp : dr;
    const float moved = x_m == -fl_inf() ? 0.0f : keep_inf(x_a, fx * (x_a + x_s * (dx - (x_ztm - h_ztm))));
    o[kZtm] = h_ztm;
    o[kCol] = r_holds ? r[kCol] : p[kCol];
    o[kA] = (h_ztm == -fl_inf() && is_finite(o[kM])) ? fl_inf() : h_a + moved;
  }
  return o;
}

// Per-row outputs, in the order of the fields of problem.Statistics (the bindings export the names, and
// fusedloss/backends/cuda/backend.py refuses an extension whose list differs).
#define FL_OUTPUTS(X)                                                                                     \
  X(kLse, "lse") X(kLogp, "logp") X(kEntropy, "entropy") X(kKlRev, "kl_rev") X(kKlFwd, "kl_fwd")          \
  X(kJsd, "jsd") X(kLseT, "lse_t") X(kKlQm, "kl_qm") X(kMeanLogit, "mean_logit")                          \
  X(kLogSumSqProbs, "log_sum_sq_probs") X(kIsTop1, "is_top1") X(kLseLo, "lse_lo") X(kLseTLo, "lse_t_lo")     \
  X(kRowMax, "row_max") X(kTeacherAtMax, "teacher_at_max") X(kKlRevRel, "kl_rev_rel")
#define FL_ENUM_ENTRY(id, name) id,
enum Output : int { FL_OUTPUTS(FL_ENUM_ENTRY) kNumOutputs };

// (m - lse) + log s: what rounding lse = m + log s dropped (m - lse is exact); 0 where not finite.
// The dz and JSD passes form log q = (z - lse) - lse_lo, exact near the maximum (problem.py).
FL_HD float rounding_residual(float lse, float m, float log_s) {
  const float lo = (m - lse) + log_s;
  return (lo - lo == 0.0f) ? lo : 0.0f;  // finite (x - x is NaN for inf and NaN)
}

struct Wants {
  bool targets, entropy, teacher, kl_rev, kl_fwd, mean_logit, extras;
  float vocab;  // V, for mean_logit
};

// The running state of the whole vocabulary -> the statistics (fusedloss/backends/torch.py::forward_statistics).
FL_HD void finalize_row(const RowState& r, float zy, const Wants& w, float out[kNumOutputs]) {
  for (int k = 0; k < kNumOutputs; ++k) out[k] = 0.0f;
  // log s = log1p(t) (s = 1 + t); log s directly for an empty row (-inf) and a non-finite s (NaN, inf).
  const float log_s = (r[kM] == -fl_inf() || !(r[kS] - r[kS] == 0.0f)) ? logf(r[kS]) : log1pf(r[kT]);
  const float lse = r[kM] + log_s;
  out[kLse] = lse;
  out[kLseLo] = rounding_residual(lse, r[kM], log_s);
  out[kRowMax] = r[kM];
  if (w.targets) out[kLogp] = (zy - r[kM]) - log_s;  // not zy - lse: see problem.py on the _lo terms
  if (w.entropy) out[kEntropy] = log_s - r[kE] / r[kS];
  if (w.mean_logit) out[kMeanLogit] = r[kSz] / w.vocab;
  if (w.extras) {
    out[kLogSumSqProbs] = logf(r[kS2]) - 2.0f * log_s;
    // y is the FIRST argmax (argmax's rule on exact ties, as TRL): z_y >= max_v z_v and z_y > max_{v<y} z_v.
    // A NaN row (s is NaN) is never top-1, as in the torch backend (its max is NaN there).
    if (w.targets) out[kIsTop1] = (zy >= r[kM] && zy > r[kMb] && r[kS] == r[kS]) ? 1.0f : 0.0f;
  }
  if (w.teacher) {
    const float log_st = logf(r[kSt]);
    out[kLseT] = r[kMt] + log_st;
    out[kLseTLo] = rounding_residual(out[kLseT], r[kMt], log_st);
    // The KLs per row in double: ... - log s + log s_t cancels to ulp(log V) if each term is rounded to fp32
    // first (core/partials.py::finalize does the same).
    const double wls = (r[kM] == -fl_inf() || !is_finite(r[kS])) ? log(double(r[kS])) : log1p(double(r[kT]));
    const double wlst = log(double(r[kSt]));
    if (w.kl_rev) {
      out[kKlRevRel] = r[kA] / r[kS];
      out[kTeacherAtMax] = r[kZtm];
      out[kKlRev] = float(double(r[kA]) / double(r[kS]) + (double(r[kMt]) - double(r[kZtm])) - wls + wlst);
    }
    if (w.kl_fwd) out[kKlFwd] = float(double(r[kB]) / double(r[kSt]) - wlst + wls);
  }
}

// ---------------------------------------------------------------------------------------------------
// Generalized JSD, second pass: m = (1 - beta) q + beta p in the log domain.
// ---------------------------------------------------------------------------------------------------
FL_HD float logaddexp(float x, float y) {
  const float hi = fmaxf(x, y);
  if (hi == -fl_inf()) return hi;
  return hi + log1pf(expf(-fabsf(x - y)));
}

struct JsdConsts {
  // beta, log(1 - beta), log(beta), formed in double on the host
  float beta = 0.5f, log_1m_beta = -0.693147180559945309f, log_beta = -0.693147180559945309f;
};

// Adds q (log q - log m) to kl_qm and p (log p - log m) to kl_pm for one column.
FL_HD void jsd_add(float logq, float logpt, const JsdConsts& j, float& kl_qm, float& kl_pm) {
  const float logm = logaddexp(logq + j.log_1m_beta, logpt + j.log_beta);
  kl_qm += xmul(expf(logq), logq - logm);
  kl_pm += xmul(expf(logpt), logpt - logm);
}

FL_HD float jsd_value(float kl_qm, float kl_pm, const JsdConsts& j) {
  return j.beta * kl_pm + (1.0f - j.beta) * kl_qm;
}

// ---------------------------------------------------------------------------------------------------
// Gradient (problem.py, docs/design.md "The dz formula"):
//   dz_j = a ([j == y] - q_j) + q_j (c0 + c1 log q_j + c2 r_j + c4 log m_j) + c3 p_j + c5
//   r_j  = (z_j - row_max) - (zt_j - teacher_at_max) - kl_rev_rel        (= log q_j - log p_j - KL(q||p))
// then dx_j = dz_j * chain_factor. The coefficient indices are problem.py's COEF_*.
// ---------------------------------------------------------------------------------------------------
enum Coef : int { kCoefOnehot = 0, kCoefConst, kCoefLogq, kCoefKlRev, kCoefTeacherProb, kCoefLogm, kCoefUniform,
                  kNumCoeffs };

struct RowCoeffs {
  float c[kNumCoeffs];
  float lse, lse_t, lse_lo, lse_t_lo;  // (hi, lo) normalisers: log q = (z - lse) - lse_lo
  float row_max, teacher_at_max, kl_rev_rel;  // the reverse KL's frame (r_j)
};

// The terms a problem can produce. A term whose coefficient the problem cannot produce is never formed,
// so that a teacher's -inf entry (log p = -inf) meets no zero coefficient (0 * inf = NaN): c1 log q only
// with entropy or JSD; c2 r only with reverse KL; c3 p only with forward KL; c4 log m only with the JSD;
// c5 only with the mean logit.
struct DzTerms {
  bool log_q, kl_rev, kl_fwd, jsd, uniform;
  FL_HD bool forms(int k) const {
    switch (k) {
      case kCoefLogq: return log_q;
      case kCoefKlRev: return kl_rev;
      case kCoefTeacherProb: return kl_fwd;
      case kCoefLogm: return jsd;
      case kCoefUniform: return uniform;
      default: return true;
    }
  }
};

template <bool kTeacher>
FL_HD float dz_element(float z, float zt, bool is_target, const RowCoeffs& k, const DzTerms& t, const JsdConsts& j) {
  const float logq = (z - k.lse) - k.lse_lo;
  const float q = fast_exp(logq);
  const float a = k.c[kCoefOnehot];
  // Off the target, a's share -a q_j joins c0; at the target c0 stays unrounded by a (an entropy or KL share
  // of a confident row would otherwise be rounded at ulp(a)).
  float inner = is_target ? k.c[kCoefConst] : k.c[kCoefConst] - a;
  if (t.log_q) inner += k.c[kCoefLogq] * logq;
  float teacher_prob = 0.0f;
  if (kTeacher) {
    // r_j from the logits relative to the forward's frame: exactly -kl_rev_rel at the student's maximum
    // column; 0 where c2 is (a row outside the loss whose KL is +inf contributes nothing).
    if (t.kl_rev) inner += xmul(k.c[kCoefKlRev], ((z - k.row_max) - (zt - k.teacher_at_max)) - k.kl_rev_rel);
    if (t.jsd || t.kl_fwd) {
      const float logpt = (zt - k.lse_t) - k.lse_t_lo;
      if (t.jsd) inner += k.c[kCoefLogm] * logaddexp(logq + j.log_1m_beta, logpt + j.log_beta);
      if (t.kl_fwd) teacher_prob = k.c[kCoefTeacherProb] * fast_exp(logpt);
    }
  }
  // 0 log 0 -> 0 where q = 0; at the target a (1 - q_y) = -a expm1(log q_y), exact to rounding for every q_y
  // (1 - q_y keeps its digits on a confident row, and a masked target gives exactly a).
  float dz = xmul(q, inner);
  if (is_target) dz -= a * expm1f(logq);
  if (t.kl_fwd) dz += teacher_prob;
  if (t.uniform) dz += k.c[kCoefUniform];
  return dz;
}

}  // namespace fl
