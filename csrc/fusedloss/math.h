// Per-element and per-row math of the statistics core (SPEC section 4, fusedloss/core/problem.py).
//
// Everything here is `FL_HD`: compiled for the device kernels (kernels.cu) AND for the host loops
// (host.cpp), so the CPU test suite checks the very functions the GPU runs. Names mirror the Python:
// the outputs lse, logp, entropy, kl_rev, kl_fwd, jsd, lse_t, kl_qm, the coefficients a, c0..c4, and the
// partial statistics (m, s, e, mt, st, a, b) of fusedloss/core/torch_backend.py.
//
// All math is fp32. Sums are kept relative to the running maxima (m for the student, mt for the teacher)
// so that peaked rows with logits near 1e4 keep the digits of their entropy and KL.
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
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

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
};

FL_HD RowState empty_state() {
  const float ninf = -fl_inf();
  return RowState{ninf, 0.0f, 0.0f, ninf, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
}

// x * y, taken as 0 when x == 0 (a probability that underflowed, times a log-ratio that may be -inf).
FL_HD float xmul(float x, float y) { return x != 0.0f ? x * y : 0.0f; }

// Fold one column (z, zt) into the running state. The rescale branch runs only when a maximum grows,
// so a column costs one exp per side. -inf logits contribute nothing; NaN and +inf propagate.
template <bool kEntropy, bool kTeacher>
FL_HD void state_add(RowState& r, float z, float zt) {
  if (z > r.m) {
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
  o.sz = r.sz + p.sz;
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

// Per-row outputs, in the order of problem.OUTPUT_NAMES.
enum Output : int {
  kLse = 0, kLogp, kEntropy, kKlRev, kKlFwd, kJsd, kLseT, kKlQm, kMeanLogit, kLogSumSqProbs, kIsTop1, kNumOutputs
};

struct Wants {
  bool targets, entropy, teacher, kl_rev, kl_fwd, mean_logit, extras;
  float vocab;  // V, for mean_logit
};

// The running state of the whole vocabulary -> the statistics (torch_backend.forward_statistics).
FL_HD void finalize_row(const RowState& r, float zy, const Wants& w, float out[kNumOutputs]) {
  for (int k = 0; k < kNumOutputs; ++k) out[k] = 0.0f;
  const float log_s = logf(r.s);
  const float lse = r.m + log_s;
  out[kLse] = lse;
  if (w.targets) out[kLogp] = zy - lse;
  if (w.entropy) out[kEntropy] = log_s - r.e / r.s;
  if (w.mean_logit) out[kMeanLogit] = r.sz / w.vocab;
  if (w.extras) {
    out[kLogSumSqProbs] = logf(r.s2) - 2.0f * log_s;
    if (w.targets) out[kIsTop1] = zy >= r.m ? 1.0f : 0.0f;
  }
  if (w.teacher) {
    const float log_st = logf(r.st);
    out[kLseT] = r.mt + log_st;
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
  float lse, lse_t;
};

template <bool kTeacher>
FL_HD float dz_element(float z, float zt, bool is_target, const RowCoeffs& k, bool jsd, const JsdConsts& j) {
  const float logq = z - k.lse;
  const float q = expf(logq);
  float inner = k.c0 + k.c1 * logq;
  float extra = 0.0f;
  if (kTeacher) {
    const float logpt = zt - k.lse_t;
    inner += k.c2 * logpt;
    if (jsd) inner += k.c4 * logaddexp(logq + j.log_1m_beta, logpt + j.log_beta);
    extra = k.c3 * expf(logpt);
  }
  float dz = xmul(q, inner) + extra + k.c5;
  if (is_target) dz += k.a;
  return dz;
}

// ---------------------------------------------------------------------------------------------------
// GRPO per-token math (SPEC section 5). One token at a time; the caller aggregates with `weight`.
// ---------------------------------------------------------------------------------------------------
enum GrpoKind : int { kGrpoClip = 0, kGrpoCispo = 1 };

struct GrpoParams {
  int kind;
  float eps_low, eps_high;
  int has_delta;
  float delta;
  float beta;
};

struct GrpoToken {
  float loss;        // l_t * m_t (importance weight and KL penalty included)
  float dlogp;       // weight_t * m_t * d l_t / d logp_t, through the per-token ratio and the KL penalty
  float dlogratio;   // weight_t * m_t * d l_t / d log r, when the ratio is given (sequence level), else 0
  float kl;          // m_t * (exp(ref - logp) - (ref - logp) - 1), 0 when beta == 0
  float is_low, is_high, is_region;  // clip indicators (TRL's definitions), times m_t
};

// logratio: log r of the token (logp - old at token level, the sequence's log r at sequence level).
// ratio_from_logp: the ratio's derivative flows to logp (token level) rather than to dlogratio.
FL_HD GrpoToken grpo_token(float logp, float logratio, bool ratio_from_logp, float adv, float mask,
                           float iw, bool has_ref, float ref, float weight, const GrpoParams& g) {
  GrpoToken o;
  const float r = expf(logratio);
  float l, dl_dr = 0.0f, dl_dlogp = 0.0f;
  if (g.kind == kGrpoCispo) {
    const float clipped = fminf(r, g.eps_high);  // sg(min(r, eps_high))
    l = -clipped * adv * logp;
    dl_dlogp = -clipped * adv;
  } else {
    // first argument r A (r <- min(r, delta)), second clamp(r, 1 - eps_low, 1 + eps_high) A
    float r1 = r, d1 = 1.0f;
    if (g.has_delta) {
      r1 = fminf(r, g.delta);
      d1 = r <= g.delta ? 1.0f : 0.0f;  // torch.clamp passes the gradient at the bound
    }
    const float lo = 1.0f - g.eps_low, hi = 1.0f + g.eps_high;
    const float r2 = fminf(fmaxf(r, lo), hi);
    const float d2 = (r >= lo && r <= hi) ? 1.0f : 0.0f;
    const float x1 = r1 * adv, x2 = r2 * adv;
    // -min(x1, x2); torch.minimum splits the gradient evenly on ties
    const float w1 = x1 < x2 ? 1.0f : (x1 == x2 ? 0.5f : 0.0f);
    l = -fminf(x1, x2);
    dl_dr = -(w1 * d1 + (1.0f - w1) * d2) * adv;
    if (x1 != x1 || x2 != x2) l = x1 + x2;  // NaN propagates (fminf would drop it)
  }
  l *= iw;
  dl_dr *= iw;
  dl_dlogp *= iw;
  float kl = 0.0f;
  if (g.beta != 0.0f && has_ref) {
    const float d = ref - logp;
    const float ed = expf(d);
    kl = ed - d - 1.0f;
    l += g.beta * kl;
    dl_dlogp += g.beta * (1.0f - ed);
  }
  // d l / d logratio = d l / d r * r
  const float dl_dlogratio = dl_dr * r;
  const bool on = mask != 0.0f;
  const float wm = weight * mask;
  o.loss = on ? l * mask : 0.0f;
  o.kl = on ? kl * mask : 0.0f;
  o.dlogp = on ? wm * (dl_dlogp + (ratio_from_logp ? dl_dlogratio : 0.0f)) : 0.0f;
  o.dlogratio = on && !ratio_from_logp ? wm * dl_dlogratio : 0.0f;
  const bool low = r < 1.0f - g.eps_low && adv < 0.0f;
  const bool high = r > 1.0f + g.eps_high && adv > 0.0f;
  o.is_low = on && low ? mask : 0.0f;
  o.is_high = on && high ? mask : 0.0f;
  o.is_region = on && (low || high) ? mask : 0.0f;
  return o;
}

// ---------------------------------------------------------------------------------------------------
// DPO per-pair math (SPEC section 5): loss and d loss / d logp_chosen, d logp_rejected.
// ---------------------------------------------------------------------------------------------------
enum DpoKind : int { kDpoSigmoid = 0, kDpoIpo = 1, kDpoHinge = 2, kDpoRobust = 3 };

struct DpoParams {
  int kind;
  float beta, label_smoothing;
};

struct DpoPair {
  float loss, d_chosen, d_rejected;
};

FL_HD float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }
FL_HD float sigmoid(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

FL_HD DpoPair dpo_pair(float logp_c, float logp_r, float ref_c, float ref_r, float n_c, float n_r,
                       const DpoParams& p) {
  const float u_c = logp_c - ref_c, u_r = logp_r - ref_r;
  const float b = p.beta, e = p.label_smoothing;
  const float x = b * (u_c - u_r);
  DpoPair o;
  float dd = 0.0f;  // d loss / d Delta
  if (p.kind == kDpoIpo) {
    const float h = u_c / n_c - u_r / n_r - 1.0f / (2.0f * b);
    o.loss = h * h;
    o.d_chosen = 2.0f * h / n_c;
    o.d_rejected = -2.0f * h / n_r;
    return o;
  }
  if (p.kind == kDpoHinge) {
    const float t = 1.0f - x;
    o.loss = fmaxf(t, 0.0f);
    if (t != t) o.loss = t;
    dd = t > 0.0f ? -b : 0.0f;
  } else if (p.kind == kDpoRobust) {
    const float inv = 1.0f / (1.0f - 2.0f * e);
    o.loss = (-(1.0f - e) * log_sigmoid(x) + e * log_sigmoid(-x)) * inv;
    dd = (-(1.0f - e) * b * sigmoid(-x) - e * b * sigmoid(x)) * inv;
  } else {  // sigmoid
    o.loss = -(1.0f - e) * log_sigmoid(x) - e * log_sigmoid(-x);
    dd = -(1.0f - e) * b * sigmoid(-x) + e * b * sigmoid(x);
  }
  o.d_chosen = dd;
  o.d_rejected = -dd;
  return o;
}

}  // namespace fl
