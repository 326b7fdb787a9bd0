// Device kernels of the CUDA backend. The math lives in fusedloss/math.h and fusedloss/tile.h (shared
// with the host loops of host.cpp); this file only maps rows and lanes onto blocks and threads.
//
//   fold_tile   one block per row: the row's columns of a raw-product tile -> partial statistics
//               (block reduction with the associative merge) -> merged into the running state, or
//               finalised into the per-row outputs (problem.Statistics) on the last vocabulary tile.
//   jsd_tile    same shape: the second sweep of the generalized JSD (needs both normalisers).
//   dx_tile     rows x column blocks: the raw-product tile -> d loss / d x, in place or into a
//               half-precision copy that feeds the cuBLAS products; or one block per row
//               (dx_packed_kernel) writing the half-precision dx over the fp32 tile it reads.
//
// Tiles come from cuBLAS in fp32 (torch.mm with out_dtype=float32 for bf16/fp16 inputs), so logits are
// never rounded to half precision before the softmax; bf16/fp16 tiles are accepted as well.
// Every launcher validates its arguments (check.h), runs under the tensors' device and gives the caller
// its current device back (device_guard.h).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "fusedloss/args.h"
#include "fusedloss/check.h"
#include "fusedloss/device_guard.h"
#include "fusedloss/math.h"
#include "fusedloss/tile.h"

namespace fl {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("fusedloss CUDA ") + what + ": " + cudaGetErrorString(err));
}

struct CudaDeviceOps {
  static int get(int* device) { return int(cudaGetDevice(device)); }
  static int set(int device) { return int(cudaSetDevice(device)); }
  static void fail(int code, const char* what) { check(cudaError_t(code), what); }
};
using CudaDeviceGuard = DeviceGuard<CudaDeviceOps>;

__device__ __forceinline__ float shfl(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

template <bool kEntropy, bool kTeacher>
__device__ RowState warp_merge(RowState r) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    RowState o = r;
#pragma unroll
    for (int k = 0; k < kRowFields; ++k)
      if (field_used<kEntropy, kTeacher>(k)) o[k] = shfl(r[k], mask);
    r = state_merge<kEntropy, kTeacher>(r, o);
  }
  return r;
}

template <typename T, bool kEntropy, bool kTeacher, bool kPlain>
__global__ void __launch_bounds__(kFoldThreads) fold_kernel(const TileArgs a) {
  __shared__ RowState warp_states[kFoldThreads / 32];
  const int64_t row = blockIdx.x;
  if (row_ignored(a, row)) {  // uniform across the block
    if (threadIdx.x == 0) fold_row_finish<kEntropy, kTeacher>(a, row, empty_state());
    return;
  }
  RowState st = fold_lane<T, kEntropy, kTeacher, kPlain>(a, row, threadIdx.x, blockDim.x);
  st = warp_merge<kEntropy, kTeacher>(st);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / 32;
    st = lane < nwarps ? warp_states[lane] : empty_state();
    st = warp_merge<kEntropy, kTeacher>(st);
    if (lane == 0) fold_row_finish<kEntropy, kTeacher>(a, row, st);
  }
}

__device__ float block_sum(float v, float* shared) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += shfl(v, mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x / 32) ? shared[lane] : 0.0f;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += shfl(v, mask);
  return v;  // valid in warp 0
}

template <typename T>
__global__ void __launch_bounds__(kFoldThreads) jsd_kernel(const TileArgs a) {
  __shared__ float shared[kFoldThreads / 32];
  const int64_t row = blockIdx.x;
  if (row_ignored(a, row)) return;
  float kl_qm = 0.0f, kl_pm = 0.0f;
  jsd_lane<T>(a, row, threadIdx.x, blockDim.x, kl_qm, kl_pm);
  kl_qm = block_sum(kl_qm, shared);
  kl_pm = block_sum(kl_pm, shared);
  if (threadIdx.x == 0) jsd_row_finish(a, row, kl_qm, kl_pm);
}

template <typename T, typename TO, bool kTeacher, bool kPlain>
__global__ void __launch_bounds__(kDxThreads) dx_kernel(const TileArgs a) {
  const int64_t row = blockIdx.x;
  const int64_t lane = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t nlanes = int64_t(gridDim.y) * blockDim.x;
  dx_lane<T, TO, kTeacher, kPlain>(a, row, lane, nlanes);
}

// The lanes of dx_packed_row on the device: this thread, its registers, the block's barrier.
struct BlockLanes {
  PackedLane r{};
  __device__ int64_t count() const { return blockDim.x; }
  template <typename F>
  __device__ void each(F&& f) { f(int64_t(threadIdx.x), r); }
  __device__ void sync() { __syncthreads(); }
};

template <typename TO, bool kTeacher, bool kPlain>
__global__ void __launch_bounds__(kDxThreads) dx_packed_kernel(const TileArgs a) {
  BlockLanes lanes;
  dx_packed_row<TO, kTeacher, kPlain>(a, blockIdx.x, lanes);
}

// The kPlain instantiations exist for fp32 tiles only: the ones the backend launches (cuBLAS writes fp32).
template <typename T, bool kPlain>
void launch_fold_as(const TileArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned(a.rows));
  const bool teacher = a.xt != 0;
  if (a.want_entropy && teacher) fold_kernel<T, true, true, kPlain><<<grid, kFoldThreads, 0, s>>>(a);
  else if (a.want_entropy) fold_kernel<T, true, false, kPlain><<<grid, kFoldThreads, 0, s>>>(a);
  else if (teacher) fold_kernel<T, false, true, kPlain><<<grid, kFoldThreads, 0, s>>>(a);
  else fold_kernel<T, false, false, kPlain><<<grid, kFoldThreads, 0, s>>>(a);
}

template <typename T>
void launch_fold(const TileArgs& a, cudaStream_t s) {
  if constexpr (std::is_same_v<T, float>) {
    if (plain_tile(a)) return launch_fold_as<T, true>(a, s);
  }
  launch_fold_as<T, false>(a, s);
}

template <typename T, typename TO, bool kPlain>
void launch_dx_as(const TileArgs& a, cudaStream_t s) {
  if constexpr (std::is_same_v<T, float> && sizeof(TO) == 2) {
    if (packed_dx(a)) {  // one block per row: the row's rounds order its reads before its writes
      if (a.xt != 0) dx_packed_kernel<TO, true, kPlain><<<unsigned(a.rows), kDxThreads, 0, s>>>(a);
      else dx_packed_kernel<TO, false, kPlain><<<unsigned(a.rows), kDxThreads, 0, s>>>(a);
      return;
    }
  }
  // Enough column blocks to fill the machine when there are few rows, each lane covering >= 4 groups.
  const int64_t per_block = int64_t(kDxThreads) * Vec<T>::kSize * 4;
  int64_t yblocks = (a.cols + per_block - 1) / per_block;
  if (yblocks < 1) yblocks = 1;
  if (yblocks > 65535) yblocks = 65535;
  const dim3 grid(unsigned(a.rows), unsigned(yblocks));
  if (a.xt != 0) dx_kernel<T, TO, true, kPlain><<<grid, kDxThreads, 0, s>>>(a);
  else dx_kernel<T, TO, false, kPlain><<<grid, kDxThreads, 0, s>>>(a);
}

template <typename T, typename TO>
void launch_dx(const TileArgs& a, cudaStream_t s) {
  if constexpr (std::is_same_v<T, float>) {
    if (plain_tile(a)) return launch_dx_as<T, TO, true>(a, s);
  }
  launch_dx_as<T, TO, false>(a, s);
}

template <typename T>
void launch_jsd(const TileArgs& a, cudaStream_t s) {
  jsd_kernel<T><<<unsigned(a.rows), kFoldThreads, 0, s>>>(a);
}

// Validates, makes the tensors' device current for the launch, restores the caller's, and reports a
// launch error with the launcher's name.
template <typename Launch>
void launch(const TileArgs& args, Kernel k, uint64_t stream, const char* name, Launch&& body) {
  validate(args, k);
  if (args.rows == 0 || (k == Kernel::kDx && args.cols == 0)) return;  // a fold of no columns still finalises
  const TileArgs a = with_reciprocals(args);
  CudaDeviceGuard guard(a.device);
  body(a, reinterpret_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), name);
}

}  // namespace

void fold_tile(const TileArgs& args, uint64_t stream) {
  launch(args, Kernel::kFold, stream, "fold_tile launch", [&](const TileArgs& a, cudaStream_t s) {
    with_dtype(a.dtype, [&](auto t) { launch_fold<decltype(t)>(a, s); });
  });
}

void jsd_tile(const TileArgs& args, uint64_t stream) {
  launch(args, Kernel::kJsd, stream, "jsd_tile launch", [&](const TileArgs& a, cudaStream_t s) {
    with_dtype(a.dtype, [&](auto t) { launch_jsd<decltype(t)>(a, s); });
  });
}

void dx_tile(const TileArgs& args, uint64_t stream) {
  launch(args, Kernel::kDx, stream, "dx_tile launch", [&](const TileArgs& a, cudaStream_t s) {
    with_dtype(a.dtype, [&](auto t) {
      with_dtype(a.dx_dtype, [&](auto o) { launch_dx<decltype(t), decltype(o)>(a, s); });
    });
  });
}

namespace {
// cudaGetDeviceCount's error, kept for availability()'s sentence (the call clears the sticky error).
std::string g_device_error;
}  // namespace

int cuda_device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    g_device_error = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  g_device_error.clear();
  return n;
}

const char* cuda_device_error() { return g_device_error.c_str(); }

int cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

int cuda_driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

}  // namespace fl
