// The d logits epilogue kernels (sm90_epilogue.cuh) for bf16 and fp16: the recompute's accumulator becomes
// d loss / d x, stored by TMA in the operands' dtype for the d hidden and d weight products.
#include <cstdio>

#include "sm90_epilogue.cuh"

namespace fl_epilogue {
namespace {

template <class Element>
int launch_dlogits(const DlogitsLaunch& a, char* error, size_t error_len) {
  using G = DlogitsGemm<Element>;
  auto args = mainloop_arguments<G>(reinterpret_cast<const void*>(a.hidden), reinterpret_cast<const void*>(a.weight),
                                    a.n, a.v, a.d);
  using StrideD = typename G::Kernel::StrideD;
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, {a.n, a.v, 1});
  cute::get<0>(stride_d) = a.ld_out;  // row-major D with padded rows
  args.epilogue = {{}, nullptr, StrideD{}, reinterpret_cast<Element*>(a.out), stride_d};
  args.epilogue.thread = {{}, {reinterpret_cast<const int64_t*>(a.target), a.target_offset,
                               reinterpret_cast<const float*>(a.coeffs), a.coeff_stride, a.logit_scale,
                               a.inv_temperature, a.chain, a.log_q ? 1 : 0}};
  return launch<G>(args, nullptr, 0, reinterpret_cast<cudaStream_t>(a.stream), error, error_len);
}

}  // namespace

int dlogits(const DlogitsLaunch& a, char* error, size_t error_len) {
  if (a.ld_out % 8 != 0 || a.ld_out < a.v) {
    snprintf(error, error_len, "d logits row stride %lld: must be a multiple of 8 and at least v = %d",
             static_cast<long long>(a.ld_out), a.v);
    return int(cutlass::Status::kErrorMisalignedOperand);
  }
  if (a.dtype == 1) return launch_dlogits<cutlass::bfloat16_t>(a, error, error_len);
  if (a.dtype == 2) return launch_dlogits<cutlass::half_t>(a, error, error_len);
  snprintf(error, error_len, "the epilogue kernels take bf16 or fp16 operands (dtype code %d)", a.dtype);
  return int(cutlass::Status::kErrorNotSupported);
}

void dlogits_info(int dtype, int* out) {
  dtype == 2 ? DlogitsGemm<cutlass::half_t>::info(out) : DlogitsGemm<cutlass::bfloat16_t>::info(out);
}

}  // namespace fl_epilogue
