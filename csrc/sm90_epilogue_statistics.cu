// The forward statistics' epilogue kernels (sm90_epilogue.cuh) for bf16 and fp16, and the merge of their tile
// partials (math.h's state_merge and finalize_row, through epilogue_math.h).
#include <cstdio>

#include "sm90_epilogue.cuh"

namespace fl_epilogue {
namespace {

template <class Element, bool kEntropy>
int launch_statistics(const StatisticsLaunch& a, char* error, size_t error_len) {
  using G = StatisticsGemm<Element, kEntropy>;
  auto args = mainloop_arguments<G>(reinterpret_cast<const void*>(a.hidden), reinterpret_cast<const void*>(a.weight),
                                    a.n, a.v, a.d);
  using StrideD = typename G::Kernel::StrideD;
  args.epilogue = {{}, nullptr, StrideD{}, nullptr, cutlass::make_cute_packed_stride(StrideD{}, {a.n, a.v, 1})};
  auto& node = args.epilogue.thread;
  node = {{}, {reinterpret_cast<float*>(a.part_m), reinterpret_cast<float*>(a.part_t),
               reinterpret_cast<float*>(a.part_e), reinterpret_cast<const int64_t*>(a.target),
               reinterpret_cast<float*>(a.target_logit), a.logit_scale, a.inv_temperature}};
  return launch<G>(args, nullptr, 0, reinterpret_cast<cudaStream_t>(a.stream), error, error_len);
}

template <bool kEntropy>
__global__ void epilogue_merge_kernel(MergeLaunch a) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= a.n) return;
  const float* m = reinterpret_cast<const float*>(a.part_m) + row;
  const float* t = reinterpret_cast<const float*>(a.part_t) + row;
  const float* e = kEntropy ? reinterpret_cast<const float*>(a.part_e) + row : nullptr;
  const bool targets = a.target != 0;
  const bool ignored = targets && reinterpret_cast<const int64_t*>(a.target)[row] < 0;
  float out[fl::kNumOutputs];
  fl::epilogue_finalize_row<kEntropy>(m, t, e, a.tiles, a.stride, reinterpret_cast<const float*>(a.target_logit)[row],
                                      targets, ignored, out);
  float* o = reinterpret_cast<float*>(a.out);
  for (int k = 0; k < fl::kNumOutputs; ++k) o[int64_t(k) * a.n + row] = out[k];
}

}  // namespace

int statistics(const StatisticsLaunch& a, char* error, size_t error_len) {
  if (a.dtype == 1) {
    return a.entropy ? launch_statistics<cutlass::bfloat16_t, true>(a, error, error_len)
                     : launch_statistics<cutlass::bfloat16_t, false>(a, error, error_len);
  }
  if (a.dtype == 2) {
    return a.entropy ? launch_statistics<cutlass::half_t, true>(a, error, error_len)
                     : launch_statistics<cutlass::half_t, false>(a, error, error_len);
  }
  snprintf(error, error_len, "the epilogue kernels take bf16 or fp16 operands (dtype code %d)", a.dtype);
  return int(cutlass::Status::kErrorNotSupported);
}

int merge(const MergeLaunch& a, char* error, size_t error_len) {
  if (a.n == 0) return 0;
  const int threads = 128, blocks = (a.n + threads - 1) / threads;
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  if (a.entropy) {
    epilogue_merge_kernel<true><<<blocks, threads, 0, stream>>>(a);
  } else {
    epilogue_merge_kernel<false><<<blocks, threads, 0, stream>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    snprintf(error, error_len, "epilogue_merge_kernel: %s", cudaGetErrorString(err));
    return int(cutlass::Status::kErrorInternal);
  }
  error[0] = '\0';
  return 0;
}

void statistics_info(int dtype, bool entropy, int* out) {
  if (dtype == 2) {
    entropy ? StatisticsGemm<cutlass::half_t, true>::info(out) : StatisticsGemm<cutlass::half_t, false>::info(out);
  } else {
    entropy ? StatisticsGemm<cutlass::bfloat16_t, true>::info(out)
            : StatisticsGemm<cutlass::bfloat16_t, false>::info(out);
  }
}

}  // namespace fl_epilogue

// The kernels' launch constants (kInfoFields) for tools/epilogue_kernels.py, which compiles these sources into a
// shared object of its own: kernel 0 the statistics, 1 the statistics with the entropy, 2 the d logits; dtype 1
// bf16, 2 fp16. Host constants only: no device is touched.
extern "C" void fusedloss_epilogue_kernel_info(int kernel, int dtype, int* out) {
  if (kernel == 2) {
    fl_epilogue::dlogits_info(dtype, out);
  } else {
    fl_epilogue::statistics_info(dtype, kernel == 1, out);
  }
}
