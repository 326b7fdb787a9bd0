// The per-logit step and the merge of the prototype's softmax partials (sm90_softmax_partials.cu), apart so that
// the host compiles the very same functions (softmax_partials_host.cpp, tests/test_cutlass_prototype.py): the
// (m, t) pair of csrc/fusedloss/math.h, s = 1 + t (docs/design.md, "Numerical doctrine").
#pragma once

#include "fusedloss/math.h"

namespace fl_proto {

// One logit z into a row's running (m, t). One exponential, no branch: e = e^-|z - m| is e^(z - m) when
// z <= m (a term of t) and e^(m - z) when z is a new maximum (the old sum, 1 + t, rescaled; the new maximum's
// own 1 stays implicit). The empty state (m = -inf, t = 0) takes its first logit to (z, 0), i.e. s = 1. Ties
// keep the first maximum and add its twin's 1 to t. NaN propagates through t.
FL_HD void add_logit(float& m, float& t, float z) {
  const float e = fl::fast_exp(-fabsf(z - m));
  const bool grow = z > m;
  t = grow ? (t + 1.0f) * e : t + e;
  m = grow ? z : m;
}

// (m, t) <- merge((m, t), (pm, pt)): math.h's state_merge restricted to the two fields. The side holding the
// maximum keeps its t, the other adds all of its columns (1 + t) rescaled; an empty side (m = -inf) adds 0.
FL_HD void merge_partial(float& m, float& t, float pm, float pt) {
  const float mo = fmaxf(m, pm);
  float fr, dr, fp, dp;
  fl::rescale_factor(m, mo, fr, dr);
  fl::rescale_factor(pm, mo, fp, dp);
  t = m >= pm ? t + fp * (1.0f + pt) : pt + fr * (1.0f + t);
  m = mo;
}

}  // namespace fl_proto
