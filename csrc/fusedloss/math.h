// Per-element and per-row math of the statistics core (SPEC section 4, fusedloss/core/problem.py).
//
// Everything here is `FL_HD`: compiled for the device kernels (kernels.cu) AND for the host loops
// (host.cpp), so the CPU test suite checks the very functions the GPU runs. Names mirror the Python:
// the outputs lse, logp, entropy, kl_rev, kl_fwd, jsd, lse_t, kl_qm, the coefficients a, c0..c4, and the
// partial statistics (m, s, e, mt, st, a, b) of fusedloss/core/torch_backend.py.
//
// The statistics math is fp32 (the GRPO/DPO per-token math at the end is templated: fp32 or double). Sums
// are kept relative to the running maxima (m for the student, mt for the teacher) so that peaked rows with
// logits near 1e4 keep the digits of their entropy and KL; log s is formed as log1p(s - 1) and the
// normaliser carries its rounding residual (lse_lo), so confident rows keep the digits of 1 - q_y.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FL_HD __host__ __device__ __forceinline__
#define FL_UNROLL _Pragma("unroll")
#else
#define FL_HD inline
#define FL_UNROLL
#endif

namespace fl {

// ---------------------------------------------------------------------------------------------------
// Storage types. bf16/fp16 are carried as raw 16-bit words so that the same code compiles without the
// CUDA headers; the conversions round to nearest even exactly like __float2bfloat16_rn/__float2half_rn.
// ---------------------------------------------------------------------------------------------------
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };  // kFloat64: GRPO/DPO math only

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
// Logits: z = softcap(logit_scale * (x + b)) / temperature (SPEC section 2), in the same operation order
// as fusedloss/core/torch_backend.py::_transform.
// ---------------------------------------------------------------------------------------------------
struct Transform {
  float logit_scale = 1.0f;
  float softcap = 0.0f;  // <= 0: no soft-cap
  float temperature = 1.0f;
  float chain = 1.0f;    // logit_scale / temperature, formed in double on the host
};

struct Logit {
  float z;  // the transformed logit
  float c;  // the soft-capped value (the chain rule needs it)
};

FL_HD Logit transform_logit(float x, float bias, const Transform& t) {
  const float u = (x + bias) * t.logit_scale;
  const float c = t.softcap > 0.0f ? t.softcap * tanhf(u / t.softcap) : u;
  return Logit{c / t.temperature, c};
}

// d z / d x, elementwise: (logit_scale / temperature) * (1 - (c / softcap)^2).
FL_HD float chain_factor(float c, const Transform& t) {
  if (t.softcap > 0.0f) {
    const float r = c / t.softcap;
    return t.chain * (1.0f - r * r);
  }
  return t.chain;
}

// ---------------------------------------------------------------------------------------------------
// Partial statistics of a set of vocabulary columns for one row (torch_backend.py docstring):
//   s = sum e^(z-m)   e = sum e^(z-m)(z-m)   st = sum e^(zt-mt)
//   a = sum e^(z-m)((z-m)-(zt-mt))           b = sum e^(zt-mt)((zt-mt)-(z-m))
// ---------------------------------------------------------------------------------------------------
struct RowState {
  float m, s, e, mt, st, a, b;
  float s2;  // sum e^(2(z-m)): log sum q^2 = log s2 - 2 log s (TRL's log_sum_sq_probs)
  float sz;  // sum z (mean_logit = sz / V); needs no maximum
  float mb;  // max of z over the columns before the target (is_top1's first-argmax rule); -inf if none
  float t;   // s - 1: the sum without the maximum column's own e^0 = 1, so that log s = log1p(t) keeps
             // the digits of a confident row (s = 1 + 1e-3 in fp32 would hold t to 1e-4 relative only)
};

FL_HD RowState empty_state() {
  const float ninf = -fl_inf();
  return RowState{ninf, 0.0f, 0.0f, ninf, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, ninf, 0.0f};
}

// x * y, taken as 0 when x == 0 (a probability that underflowed, times a log-ratio that may be -inf).
FL_HD float xmul(float x, float y) { return x != 0.0f ? x * y : 0.0f; }

// Fold one column (z, zt) into the running state. The rescale branch runs only when a maximum grows,
// so a column costs one exp per side. -inf logits contribute nothing; NaN and +inf propagate.
template <bool kEntropy, bool kTeacher>
FL_HD void state_add(RowState& r, float z, float zt) {
  const bool new_max = z > r.m;
  if (new_max) {
    if (r.m != -fl_inf()) {
      const float dm = r.m - z;
      const float f = expf(dm);
      if (kEntropy) r.e = f * (r.e + r.s * dm);
      if (kTeacher) {
        r.a = f * (r.a + r.s * dm);
        r.b = r.b - r.st * dm;
      }
      r.s *= f;
      r.s2 *= f * f;
      r.t = (r.t + 1.0f) * f;  // the old maximum column now contributes f
    }
    r.m = z;
  }
  if (kTeacher && zt > r.mt) {
    if (r.mt != -fl_inf()) {
      const float dmt = r.mt - zt;
      const float g = expf(dmt);
      r.a = r.a - r.s * dmt;
      r.b = g * (r.b + r.st * dmt);
      r.st *= g;
    }
    r.mt = zt;
  }
  const float d = z - r.m;
  const float ez = z == -fl_inf() ? 0.0f : expf(d);
  r.s += ez;
  if (!new_max) r.t += ez;  // the new maximum contributes the implicit 1
  r.s2 += ez * ez;
  r.sz += z;
  if (kEntropy) r.e += xmul(ez, d);
  if (kTeacher) {
    const float dt = zt - r.mt;
    const float ezt = zt == -fl_inf() ? 0.0f : expf(dt);
    r.st += ezt;
    r.a += xmul(ez, d - dt);
    r.b += xmul(ezt, dt - d);
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

// The associative merge (torch_backend.py::_merge): used by the block reductions and by the fold of
// a tile's partials into the running state of the previous tiles.
template <bool kEntropy, bool kTeacher>
FL_HD RowState state_merge(const RowState& r, const RowState& p) {
  RowState o;
  o.m = fmaxf(r.m, p.m);
  float fr, dr, fp, dp;
  rescale_factor(r.m, o.m, fr, dr);
  rescale_factor(p.m, o.m, fp, dp);
  o.s = fr * r.s + fp * p.s;
  o.s2 = fr * fr * r.s2 + fp * fp * p.s2;
  // t: the side holding the maximum keeps its t; the other adds all of its columns (1 + t), rescaled.
  o.t = r.m >= p.m ? r.t + fp * (1.0f + p.t) : p.t + fr * (1.0f + r.t);
  o.sz = r.sz + p.sz;
  o.mb = fmaxf(r.mb, p.mb);
  o.e = kEntropy ? fr * (r.e + r.s * dr) + fp * (p.e + p.s * dp) : 0.0f;
  if (kTeacher) {
    o.mt = fmaxf(r.mt, p.mt);
    float gr, drt, gp, dpt;
    rescale_factor(r.mt, o.mt, gr, drt);
    rescale_factor(p.mt, o.mt, gp, dpt);
    o.st = gr * r.st + gp * p.st;
    o.a = fr * (r.a + r.s * (dr - drt)) + fp * (p.a + p.s * (dp - dpt));
    o.b = gr * (r.b + r.st * (drt - dr)) + gp * (p.b + p.st * (dpt - dp));
  } else {
    o.mt = r.mt;
    o.st = 0.0f;
    o.a = 0.0f;
    o.b = 0.0f;
  }
  return o;
}

// Per-row outputs, in the order of the fields of problem.Statistics.
enum Output : int {
  kLse = 0, kLogp, kEntropy, kKlRev, kKlFwd, kJsd, kLseT, kKlQm, kMeanLogit, kLogSumSqProbs, kIsTop1, kLseLo, kLseTLo,
  kRowMax, kNumOutputs
};

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

// The running state of the whole vocabulary -> the statistics (torch_backend.forward_statistics).
FL_HD void finalize_row(const RowState& r, float zy, const Wants& w, float out[kNumOutputs]) {
  for (int k = 0; k < kNumOutputs; ++k) out[k] = 0.0f;
  // log s = log1p(t) (s = 1 + t); log s directly for an empty row (-inf) and a non-finite s (NaN, inf).
  const float log_s = (r.m == -fl_inf() || !(r.s - r.s == 0.0f)) ? logf(r.s) : log1pf(r.t);
  const float lse = r.m + log_s;
  out[kLse] = lse;
  out[kLseLo] = rounding_residual(lse, r.m, log_s);
  out[kRowMax] = r.m;
  if (w.targets) out[kLogp] = (zy - r.m) - log_s;  // not zy - lse: see problem.py on the _lo terms
  if (w.entropy) out[kEntropy] = log_s - r.e / r.s;
  if (w.mean_logit) out[kMeanLogit] = r.sz / w.vocab;
  if (w.extras) {
    out[kLogSumSqProbs] = logf(r.s2) - 2.0f * log_s;
    // y is the FIRST argmax (argmax's rule on exact ties, as TRL): z_y >= max_v z_v and z_y > max_{v<y} z_v.
    // A NaN row (s is NaN) is never top-1, as in the torch backend (its max is NaN there).
    if (w.targets) out[kIsTop1] = (zy >= r.m && zy > r.mb && r.s == r.s) ? 1.0f : 0.0f;
  }
  if (w.teacher) {
    const float log_st = logf(r.st);
    out[kLseT] = r.mt + log_st;
    out[kLseTLo] = rounding_residual(out[kLseT], r.mt, log_st);
    if (w.kl_rev) out[kKlRev] = r.a / r.s - log_s + log_st;
    if (w.kl_fwd) out[kKlFwd] = r.b / r.st - log_st + log_s;
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
  float beta, log_1m_beta, log_beta;  // beta, log(1 - beta), log(beta), formed in double on the host
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
// Gradient: dz_j = a [j == y] + q_j (c0 + c1 log q_j + c2 log p_j + c4 log m_j) + c3 p_j + c5
// (problem.py), then dx_j = dz_j * chain_factor.
// ---------------------------------------------------------------------------------------------------
struct RowCoeffs {
  float a, c0, c1, c2, c3, c4, c5;
  float lse, lse_t, lse_lo, lse_t_lo;  // (hi, lo) normalisers: log q = (z - lse) - lse_lo
};

template <bool kTeacher>
FL_HD float dz_element(float z, float zt, bool is_target, const RowCoeffs& k, bool jsd, const JsdConsts& j) {
  const float logq = (z - k.lse) - k.lse_lo;
  const float q = expf(logq);
  float inner = k.c0 + k.c1 * logq;
  float extra = 0.0f;
  if (kTeacher) {
    const float logpt = (zt - k.lse_t) - k.lse_t_lo;
    inner += k.c2 * logpt;
    if (jsd) inner += k.c4 * logaddexp(logq + j.log_1m_beta, logpt + j.log_beta);
    extra = k.c3 * expf(logpt);
  }
  // The target column: a + q inner = (a + inner) + inner (q - 1), with q - 1 = expm1(log q) exact to
  // rounding. For log-probability terms a + inner cancels exactly (a = -c0), which keeps the digits of
  // 1 - q_y on a confident row (1e-4 in fp32 would otherwise carry q's rounding, 6e-8, as 6e-4 relative).
  float dz;
  if (is_target && q != 0.0f) dz = ((k.a + inner) + inner * expm1f(logq)) + extra + k.c5;
  else dz = xmul(q, inner) + extra + k.c5 + (is_target ? k.a : 0.0f);
  return dz;
}

// ---------------------------------------------------------------------------------------------------
// GRPO per-token and DPO per-pair math (SPEC section 5), templated on the compute type S (float for
// fp32/bf16/fp16 inputs, double for float64 ones), in the operation order of fusedloss/losses/grpo.py and
// dpo.py so that the fused launches agree with the loss modules to rounding. Constants that the modules
// form from Python floats (1 - eps_low, 1 / (2 beta), ...) are formed in double on the host and rounded
// once to S, as torch does with a Python scalar.
// ---------------------------------------------------------------------------------------------------
FL_HD float s_exp(float x) { return expf(x); }
FL_HD double s_exp(double x) { return exp(x); }
FL_HD float s_log1p(float x) { return log1pf(x); }
FL_HD double s_log1p(double x) { return log1p(x); }
FL_HD float s_abs(float x) { return fabsf(x); }
FL_HD double s_abs(double x) { return fabs(x); }

// torch.clamp / torch.minimum semantics: NaN propagates (fminf/fmaxf would drop it).
template <typename S> FL_HD S clamp_max(S x, S hi) { return x > hi ? hi : x; }
template <typename S> FL_HD S clamp_min(S x, S lo) { return x < lo ? lo : x; }
template <typename S> FL_HD S nan_min(S x, S y) { return (x != x || y != y) ? x + y : (y < x ? y : x); }

enum GrpoKind : int { kGrpoClip = 0, kGrpoCispo = 1 };

struct GrpoParams {
  int kind;
  double eps_low, eps_high;  // eps_high already resolved (None -> eps_low)
  int has_delta;
  double delta;
  double beta;
  double clip_low, clip_high;  // 1 - eps_low, 1 + eps_high (formed in double)
};

template <typename S>
struct GrpoToken {
  S loss;       // l_t * m_t (importance weight and KL penalty included)
  S dlogp;      // weight_t * m_t * d l_t / d logp_t, through the per-token ratio and the KL penalty
  S dlogratio;  // weight_t * m_t * d l_t / d log r, when the ratio is given (sequence level), else 0
  S kl;         // m_t * (exp(ref - logp) - (ref - logp) - 1), 0 when beta == 0
  S is_low, is_high, is_region;  // clip indicators (TRL's definitions, on the ratio below), times m_t
  S ratio;      // the ratio of the clip metrics: min(r, delta) (non-cispo with delta), else r
};

// logratio: log r of the token (logp - old at token level, masked to 0 on masked tokens; the sequence's
// log r at sequence level). ratio_from_logp: the ratio's derivative flows to logp (token level) rather
// than to dlogratio.
template <typename S>
FL_HD GrpoToken<S> grpo_token(S logp, S logratio, bool ratio_from_logp, S adv, S mask, S iw, bool has_ref, S ref,
                              S weight, const GrpoParams& g) {
  GrpoToken<S> o;
  const S zero = S(0), one = S(1);
  const S r = s_exp(logratio);
  S l, dl_dr = zero, dl_dlogp = zero, ratio = r;
  if (g.kind == kGrpoCispo) {
    const S clipped = clamp_max(r, S(g.eps_high));  // sg(min(r, eps_high))
    l = -clipped * adv * logp;
    dl_dlogp = -clipped * adv;
  } else {
    // -min(r1 A, clamp(r, 1 - eps_low, 1 + eps_high) A), r1 = min(r, delta) when delta is set
    const S lo = S(g.clip_low), hi = S(g.clip_high);
    const S r2 = clamp_max(clamp_min(r, lo), hi);
    const S d2 = (r >= lo && r <= hi) ? one : zero;  // torch.clamp passes the gradient at the bounds
    S r1 = r, d1 = one;
    if (g.has_delta) {
      r1 = clamp_max(r, S(g.delta));
      d1 = r <= S(g.delta) ? one : zero;
    }
    ratio = r1;
    const S x1 = r1 * adv, x2 = r2 * adv;
    const S w1 = x1 < x2 ? one : (x1 == x2 ? S(0.5) : zero);  // torch.minimum splits the gradient on ties
    l = -nan_min(x1, x2);
    dl_dr = -(w1 * d1 + (one - w1) * d2) * adv;
  }
  l *= iw;
  dl_dr *= iw;
  dl_dlogp *= iw;
  S kl = zero;
  if (g.beta != 0.0 && has_ref) {
    const S b = S(g.beta);
    const S d = ref - logp;
    const S ed = s_exp(d);
    kl = ed - d - one;
    l += b * kl;
    dl_dlogp -= b * ed - b;
  }
  const S dl_dlogratio = dl_dr * r;  // d l / d log r = d l / d r * r
  const bool on = mask != zero;
  const S wm = weight * mask;
  o.loss = on ? l * mask : zero;
  o.kl = on ? kl * mask : zero;
  o.dlogp = on ? wm * (dl_dlogp + (ratio_from_logp ? dl_dlogratio : zero)) : zero;
  o.dlogratio = on && !ratio_from_logp ? wm * dl_dlogratio : zero;
  o.ratio = ratio;
  bool low, high;
  if (g.kind == kGrpoCispo) {  // TRL tracks only the upper clip of CISPO (its cispo_clip_ratio)
    low = false;
    high = ratio > S(g.eps_high) && adv > zero;
  } else {
    low = ratio < S(g.clip_low) && adv < zero;
    high = ratio > S(g.clip_high) && adv > zero;
  }
  o.is_low = on && low ? mask : zero;
  o.is_high = on && high ? mask : zero;
  o.is_region = on && (low || high) ? mask : zero;
  return o;
}

enum DpoKind : int { kDpoSigmoid = 0, kDpoIpo = 1, kDpoHinge = 2, kDpoRobust = 3 };

struct DpoParams {
  int kind;
  double beta, label_smoothing;
  double one_minus_e, half_inv_beta, one_minus_2e;  // 1 - e, 1 / (2 beta), 1 - 2 e (formed in double)
};

template <typename S>
struct DpoPair {
  S loss, d_chosen, d_rejected;
};

// torch's log_sigmoid: min(x, 0) - log1p(exp(-|x|)); its derivative sigmoid(-x) in torch's form.
template <typename S> FL_HD S log_sigmoid(S x) { return (x < S(0) ? x : S(0)) - s_log1p(s_exp(-s_abs(x))); }
template <typename S> FL_HD S log_sigmoid_grad(S x) {
  const S z = s_exp(-s_abs(x));
  return x < S(0) ? S(1) - z / (S(1) + z) : z / (S(1) + z);
}
template <typename S> FL_HD S sigmoid(S x) { return log_sigmoid_grad(-x); }

// ipo's n_c, n_r are the completion token counts (>= 1; the caller applies max(1, n)).
template <typename S>
FL_HD DpoPair<S> dpo_pair(S logp_c, S logp_r, S ref_c, S ref_r, S n_c, S n_r, const DpoParams& p) {
  const S u_c = logp_c - ref_c, u_r = logp_r - ref_r;
  const S b = S(p.beta), e = S(p.label_smoothing), ome = S(p.one_minus_e);
  const S x = b * (u_c - u_r);
  DpoPair<S> o;
  S dd = S(0);  // d loss / d Delta
  if (p.kind == kDpoIpo) {
    const S h = u_c / n_c - u_r / n_r - S(p.half_inv_beta);
    o.loss = h * h;
    o.d_chosen = S(2) * h / n_c;
    o.d_rejected = -(S(2) * h) / n_r;
    return o;
  }
  if (p.kind == kDpoHinge) {
    const S t = S(1) - x;
    o.loss = t > S(0) ? t : (t != t ? t : S(0));  // relu, NaN propagates
    dd = t > S(0) ? -b : S(0);
  } else if (p.kind == kDpoRobust) {
    const S den = S(p.one_minus_2e);
    o.loss = (-ome * log_sigmoid(x) + e * log_sigmoid(-x)) / den;
    dd = (-ome * log_sigmoid_grad(x) * b - e * log_sigmoid_grad(-x) * b) / den;
  } else {  // sigmoid
    o.loss = -ome * log_sigmoid(x) - e * log_sigmoid(-x);
    dd = -ome * log_sigmoid_grad(x) * b + e * log_sigmoid_grad(-x) * b;
  }
  o.d_chosen = dd;
  o.d_rejected = -dd;
  return o;
}

}  // namespace fl
