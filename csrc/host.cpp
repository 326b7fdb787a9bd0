// Host loops over CPU pointers: the same row and lane functions as the device kernels (tile.h, math.h),
// so the CPU test suite (tests/contract/test_cuda_host_twins.py) checks the kernels' numerics without a GPU.
// A row is split into kFoldThreads lanes exactly like a block of fold_kernel, and the lanes' partial
// statistics are combined with the same associative merge.
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "fusedloss/args.h"
#include "fusedloss/check.h"
#include "fusedloss/math.h"
#include "fusedloss/tile.h"

namespace fl {
namespace {

template <typename T, bool kEntropy, bool kTeacher, bool kPlain>
void host_fold(const TileArgs& a) {
  for (int64_t row = 0; row < a.rows; ++row) {
    RowState st = empty_state();
    if (!row_ignored(a, row)) {
      // Pairwise tree over the lanes, like the warp shuffles (xor 16, 8, ..., 1) then the warps.
      std::vector<RowState> lanes(kFoldThreads);
      for (int lane = 0; lane < kFoldThreads; ++lane) lanes[lane] = fold_lane<T, kEntropy, kTeacher, kPlain>(a, row, lane, kFoldThreads);
      for (int width = kFoldThreads / 2; width > 0; width /= 2)
        for (int lane = 0; lane < width; ++lane) lanes[lane] = state_merge<kEntropy, kTeacher>(lanes[lane], lanes[lane + width]);
      st = lanes[0];
    }
    fold_row_finish<kEntropy, kTeacher>(a, row, st);
  }
}

// The device's choice of instantiation (kernels.cu): kPlain for fp32 tiles without a transform.
template <typename T, bool kPlain>
void host_fold_as(const TileArgs& a) {
  const bool teacher = a.xt != 0;
  if (a.want_entropy && teacher) host_fold<T, true, true, kPlain>(a);
  else if (a.want_entropy) host_fold<T, true, false, kPlain>(a);
  else if (teacher) host_fold<T, false, true, kPlain>(a);
  else host_fold<T, false, false, kPlain>(a);
}

template <typename T>
void host_fold_t(const TileArgs& a) {
  if (std::is_same_v<T, float> && plain_tile(a)) host_fold_as<T, true>(a);
  else host_fold_as<T, false>(a);
}

template <typename T>
void host_jsd_t(const TileArgs& a) {
  for (int64_t row = 0; row < a.rows; ++row) {
    if (row_ignored(a, row)) continue;
    float kl_qm = 0.0f, kl_pm = 0.0f;
    for (int lane = 0; lane < kFoldThreads; ++lane) {
      float q = 0.0f, p = 0.0f;
      jsd_lane<T>(a, row, lane, kFoldThreads, q, p);
      kl_qm += q;
      kl_pm += p;
    }
    jsd_row_finish(a, row, kl_qm, kl_pm);
  }
}

// The lanes of a packed dx row on the host: kDxThreads of them, each with its registers, run one after
// another between the barriers (a round's loads by every lane, then its stores), as the device block does.
struct HostLanes {
  std::vector<PackedLane> r = std::vector<PackedLane>(kDxThreads);
  int64_t count() const { return kDxThreads; }
  template <typename F>
  void each(F&& f) {
    for (int64_t lane = 0; lane < kDxThreads; ++lane) f(lane, r[size_t(lane)]);
  }
  void sync() {}
};

template <typename T, typename TO, bool kPlain>
void host_dx_as(const TileArgs& a) {
  if constexpr (std::is_same_v<T, float> && sizeof(TO) == 2) {
    if (packed_dx(a)) {
      HostLanes lanes;
      for (int64_t row = 0; row < a.rows; ++row) {
        if (a.xt != 0) dx_packed_row<TO, true, kPlain>(a, row, lanes);
        else dx_packed_row<TO, false, kPlain>(a, row, lanes);
      }
      return;
    }
  }
  for (int64_t row = 0; row < a.rows; ++row) {
    if (a.xt != 0) dx_lane<T, TO, true, kPlain>(a, row, 0, 1);
    else dx_lane<T, TO, false, kPlain>(a, row, 0, 1);
  }
}

template <typename T, typename TO>
void host_dx_t(const TileArgs& a) {
  if (std::is_same_v<T, float> && plain_tile(a)) host_dx_as<T, TO, true>(a);
  else host_dx_as<T, TO, false>(a);
}

}  // namespace

void host_fold_tile(const TileArgs& args) {
  validate(args, Kernel::kFold);
  const TileArgs a = with_reciprocals(args);
  with_dtype(a.dtype, [&](auto t) { host_fold_t<decltype(t)>(a); });
}

void host_jsd_tile(const TileArgs& args) {
  validate(args, Kernel::kJsd);
  const TileArgs a = with_reciprocals(args);
  with_dtype(a.dtype, [&](auto t) { host_jsd_t<decltype(t)>(a); });
}

void host_dx_tile(const TileArgs& args) {
  validate(args, Kernel::kDx);
  const TileArgs a = with_reciprocals(args);
  with_dtype(a.dtype, [&](auto t) { with_dtype(a.dx_dtype, [&](auto o) { host_dx_t<decltype(t), decltype(o)>(a); }); });
}

}  // namespace fl
