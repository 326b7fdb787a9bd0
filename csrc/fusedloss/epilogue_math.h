// The math of the sm_90 epilogue kernels (sm90_epilogue.cuh): the per-logit step and lane merge of the forward
// statistics' tile partials, their merge over vocabulary tiles into math.h's RowState and its finalize_row, and
// the d logits of one element (math.h's dz_element). FL_HD: the device kernels and the host twins
// (epilogue_host.cpp, tests/contract/test_cuda_epilogue_twins.py) compile these very functions (docs/design.md, "The
// statistics in the GEMM epilogue").
//
// Per (row, vocabulary tile) the forward kernel writes three floats: m (the tile's row maximum), t (the sum of
// e^(z - m) without the maximum's own 1: s = 1 + t, math.h's kT) and e (the sum of e^(z - m) (z - m): math.h's
// kE, the entropy's sum), and, from the one tile holding it, the target logit.
#pragma once

#include "fusedloss/math.h"

namespace fl {

// z = (acc * logit_scale) * (1 / temperature): transform_logit's order without soft-cap and bias, the only
// transforms the epilogue path serves (fusedloss/backends/cuda/epilogue.py decides).
FL_HD float epilogue_logit(float acc, float logit_scale, float inv_temperature) {
  return (acc * logit_scale) * inv_temperature;
}

// One logit into a lane's running (m, t, e), one exponential and no branch on data: x = e^-|z - m| is the new
// column's term when z <= m and the old sum's rescale factor when z is a new maximum (whose own term, e^0 and
// 0 * e^0, stays implicit). The empty state (-inf, 0, 0) takes its first logit to (z, 0, 0). NaN propagates.
template <bool kEntropy>
FL_HD void epilogue_add_logit(float& m, float& t, float& e, float z) {
  const float d = z - m;
  const float x = fast_exp(-fabsf(d));
  const bool grow = z > m;
  if (kEntropy) e = grow ? xmul(x, e - (1.0f + t) * d) : e + xmul(x, d);
  t = grow ? (t + 1.0f) * x : t + x;
  m = grow ? z : m;
}

// (m, t, e) <- merge((m, t, e), (pm, pt, pe)): state_merge's (m, t, e) fields, with s = 1 + t. An empty side
// (m = -inf) adds nothing.
template <bool kEntropy>
FL_HD void epilogue_merge(float& m, float& t, float& e, float pm, float pt, float pe) {
  const float mo = fmaxf(m, pm);
  float fr, dr, fp, dp;
  rescale_factor(m, mo, fr, dr);
  rescale_factor(pm, mo, fp, dp);
  if (kEntropy) e = xmul(fr, e + (1.0f + t) * dr) + xmul(fp, pe + (1.0f + pt) * dp);
  t = m >= pm ? t + fp * (1.0f + pt) : pt + fr * (1.0f + t);
  m = mo;
}

// A tile partial as math.h's RowState (the fields the epilogue path serves: m, s, t, e).
FL_HD RowState epilogue_state(float m, float t, float e) {
  RowState r = empty_state();
  r[kM] = m;
  r[kT] = t;
  r[kS] = m == -fl_inf() ? 0.0f : 1.0f + t;
  r[kE] = e;
  return r;
}

// One row's tile partials (tile j at m[j * stride], t[...], e[...]) merged in tile order by state_merge, then
// finalize_row: lse, lse_lo, row_max, logp (targets: zy) and entropy in `out` (kNumOutputs, problem.Statistics'
// order). An ignored row (a negative target) gets zeros everywhere, as the fold kernels write (tile.h).
template <bool kEntropy>
FL_HD void epilogue_finalize_row(const float* m, const float* t, const float* e, int tiles, int64_t stride, float zy,
                                 bool targets, bool ignored, float* out) {
  if (ignored) {
    for (int k = 0; k < kNumOutputs; ++k) out[k] = 0.0f;
    return;
  }
  RowState r = empty_state();
  for (int j = 0; j < tiles; ++j) {
    const int64_t i = int64_t(j) * stride;
    r = state_merge<kEntropy, false>(r, epilogue_state(m[i], t[i], kEntropy ? e[i] : 0.0f));
  }
  Wants w{};
  w.targets = targets;
  w.entropy = kEntropy;
  finalize_row(r, zy, w, out);
}

// The per-row inputs of the d logits epilogue: math.h's RowCoeffs restricted to what a problem without teacher,
// bias, soft-cap or mean logit forms (c0, c1 log q, a at the target).
struct EpilogueRowCoeffs {
  float lse, lse_lo, onehot, constant, logq;
};

// d loss / d x of one element in fp32 (dz_element of math.h, times the transform's chain factor), rounded by
// the caller to the product's operand dtype. `log_q`: whether c1 is formed (entropy terms).
FL_HD float epilogue_dlogit(float z, bool is_target, const EpilogueRowCoeffs& k, bool log_q, float chain) {
  RowCoeffs c{};
  c.c[kCoefOnehot] = k.onehot;
  c.c[kCoefConst] = k.constant;
  c.c[kCoefLogq] = k.logq;
  c.lse = k.lse;
  c.lse_lo = k.lse_lo;
  DzTerms terms{log_q, false, false, false, false};
  return dz_element<false>(z, 0.0f, is_target, c, terms, JsdConsts{}) * chain;
}

}  // namespace fl
