// Device kernels of the CUDA backend. The math lives in fusedloss/math.h and fusedloss/tile.h (shared
// with the host loops of host.cpp); this file only maps rows and lanes onto blocks and threads.
//
//   fold_tile   one block per row: the row's columns of a raw-product tile -> partial statistics
//               (block reduction with the associative merge) -> merged into the running state, or
//               finalised into the per-row outputs (problem.Statistics) on the last vocabulary tile.
//   jsd_tile    same shape: the second sweep of the generalized JSD (needs both normalisers).
//   dx_tile     rows x column blocks: the raw-product tile -> d loss / d x, in place or into a
//               half-precision copy that feeds the cuBLAS products.
//   grpo_tokens, dpo_pairs: the per-token / per-pair loss math of SPEC section 5, one launch each.
//
// Tiles come from cuBLAS in fp32 (torch.mm with out_dtype=float32 for bf16/fp16 inputs), so logits are
// never rounded to half precision before the softmax; bf16/fp16 tiles are accepted as well.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "fusedloss/args.h"
#include "fusedloss/math.h"
#include "fusedloss/tile.h"

namespace fl {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("fusedloss CUDA ") + what + ": " + cudaGetErrorString(err));
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

__device__ __forceinline__ float shfl(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

template <bool kEntropy, bool kTeacher>
__device__ RowState warp_merge(RowState r) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    RowState o;
    o.m = shfl(r.m, mask);
    o.s = shfl(r.s, mask);
    o.e = kEntropy ? shfl(r.e, mask) : 0.0f;
    o.mt = kTeacher ? shfl(r.mt, mask) : r.mt;
    o.st = kTeacher ? shfl(r.st, mask) : 0.0f;
    o.a = kTeacher ? shfl(r.a, mask) : 0.0f;
    o.b = kTeacher ? shfl(r.b, mask) : 0.0f;
    o.s2 = shfl(r.s2, mask);
    o.sz = shfl(r.sz, mask);
    o.mb = shfl(r.mb, mask);
    o.t = shfl(r.t, mask);
    r = state_merge<kEntropy, kTeacher>(r, o);
  }
  return r;
}

template <typename T, bool kEntropy, bool kTeacher>
__global__ void __launch_bounds__(kFoldThreads) fold_kernel(const TileArgs a) {
  __shared__ RowState warp_states[kFoldThreads / 32];
  const int64_t row = blockIdx.x;
  if (row_ignored(a, row)) {  // uniform across the block
    if (threadIdx.x == 0) fold_row_finish<kEntropy, kTeacher>(a, row, empty_state());
    return;
  }
  RowState st = fold_lane<T, kEntropy, kTeacher>(a, row, threadIdx.x, blockDim.x);
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
  __syncthreads();
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

constexpr int kDxThreads = 256;

template <typename T, typename TO, bool kTeacher>
__global__ void __launch_bounds__(kDxThreads) dx_kernel(const TileArgs a) {
  const int64_t row = blockIdx.x;
  const int64_t lane = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t nlanes = int64_t(gridDim.y) * blockDim.x;
  dx_lane<T, TO, kTeacher>(a, row, lane, nlanes);
}

template <typename S>
__global__ void grpo_kernel(const GrpoArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.n) grpo_element<S>(a, i);
}

template <typename S>
__global__ void dpo_kernel(const DpoArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.n) dpo_element<S>(a, i);
}

template <typename T>
void launch_fold(const TileArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned(a.rows));
  const bool teacher = a.xt != 0;
  if (a.want_entropy && teacher) fold_kernel<T, true, true><<<grid, kFoldThreads, 0, s>>>(a);
  else if (a.want_entropy) fold_kernel<T, true, false><<<grid, kFoldThreads, 0, s>>>(a);
  else if (teacher) fold_kernel<T, false, true><<<grid, kFoldThreads, 0, s>>>(a);
  else fold_kernel<T, false, false><<<grid, kFoldThreads, 0, s>>>(a);
}

template <typename T, typename TO>
void launch_dx_out(const TileArgs& a, cudaStream_t s) {
  // Enough column blocks to fill the machine when there are few rows, each lane covering >= 4 groups.
  const int64_t per_block = int64_t(kDxThreads) * Vec<T>::kSize * 4;
  int64_t yblocks = (a.cols + per_block - 1) / per_block;
  if (yblocks < 1) yblocks = 1;
  if (yblocks > 65535) yblocks = 65535;
  const dim3 grid(unsigned(a.rows), unsigned(yblocks));
  if (a.xt != 0) dx_kernel<T, TO, true><<<grid, kDxThreads, 0, s>>>(a);
  else dx_kernel<T, TO, false><<<grid, kDxThreads, 0, s>>>(a);
}

template <typename T>
void launch_dx(const TileArgs& a, cudaStream_t s) {
  switch (a.dx_dtype) {
    case kBFloat16: launch_dx_out<T, bf16>(a, s); break;
    case kFloat16: launch_dx_out<T, fp16>(a, s); break;
    default: launch_dx_out<T, float>(a, s); break;
  }
}

void validate(const TileArgs& a) {
  if (a.rows < 0 || a.cols < 0) throw std::invalid_argument("fusedloss: negative tile shape");
  if (a.rows > 2147483647LL) throw std::invalid_argument("fusedloss: too many rows in one tile");
  if (a.x == 0 || a.out == 0) throw std::invalid_argument("fusedloss: null tile or output pointer");
}

}  // namespace

void fold_tile(const TileArgs& a, uint64_t stream) {
  validate(a);
  if (a.rows == 0) return;
  if ((!a.first || !a.last) && a.state == 0) throw std::invalid_argument("fusedloss: fold over several tiles needs state");
  set_device(a.device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case kBFloat16: launch_fold<bf16>(a, s); break;
    case kFloat16: launch_fold<fp16>(a, s); break;
    default: launch_fold<float>(a, s); break;
  }
  check(cudaGetLastError(), "fold_tile launch");
}

void jsd_tile(const TileArgs& a, uint64_t stream) {
  validate(a);
  if (a.rows == 0) return;
  if (a.xt == 0 || (!a.last && a.jsd_acc == 0) || (!a.first && a.jsd_acc == 0))
    throw std::invalid_argument("fusedloss: jsd_tile needs a teacher tile and accumulators");
  set_device(a.device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case kBFloat16: jsd_kernel<bf16><<<unsigned(a.rows), kFoldThreads, 0, s>>>(a); break;
    case kFloat16: jsd_kernel<fp16><<<unsigned(a.rows), kFoldThreads, 0, s>>>(a); break;
    default: jsd_kernel<float><<<unsigned(a.rows), kFoldThreads, 0, s>>>(a); break;
  }
  check(cudaGetLastError(), "jsd_tile launch");
}

void dx_tile(const TileArgs& a, uint64_t stream) {
  validate(a);
  if (a.rows == 0 || a.cols == 0) return;
  if (a.dx == 0 || a.coeffs == 0) throw std::invalid_argument("fusedloss: dx_tile needs dx and coefficients");
  set_device(a.device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case kBFloat16: launch_dx<bf16>(a, s); break;
    case kFloat16: launch_dx<fp16>(a, s); break;
    default: launch_dx<float>(a, s); break;
  }
  check(cudaGetLastError(), "dx_tile launch");
}

void grpo_tokens(const GrpoArgs& a, uint64_t stream) {
  if (a.n <= 0) return;
  if (a.out == 0 || a.logp == 0) throw std::invalid_argument("fusedloss: grpo_tokens needs logp and out");
  if (a.dtype != kFloat32 && a.dtype != kFloat64) throw std::invalid_argument("fusedloss: grpo_tokens dtype");
  set_device(a.device);
  const int threads = 256;
  const int64_t blocks = (a.n + threads - 1) / threads;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (a.dtype == kFloat64) grpo_kernel<double><<<unsigned(blocks), threads, 0, s>>>(a);
  else grpo_kernel<float><<<unsigned(blocks), threads, 0, s>>>(a);
  check(cudaGetLastError(), "grpo_tokens launch");
}

void dpo_pairs(const DpoArgs& a, uint64_t stream) {
  if (a.n <= 0) return;
  if (a.out == 0) throw std::invalid_argument("fusedloss: dpo_pairs needs out");
  if (a.dtype != kFloat32 && a.dtype != kFloat64) throw std::invalid_argument("fusedloss: dpo_pairs dtype");
  set_device(a.device);
  const int threads = 128;
  const int64_t blocks = (a.n + threads - 1) / threads;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (a.dtype == kFloat64) dpo_kernel<double><<<unsigned(blocks), threads, 0, s>>>(a);
  else dpo_kernel<float><<<unsigned(blocks), threads, 0, s>>>(a);
  check(cudaGetLastError(), "dpo_pairs launch");
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace fl
