// Python bindings of fusedloss._C. Pointers, shapes, strides, dtype codes and the CUDA stream travel as
// plain integers, so the extension links only against the CUDA runtime (statically) and pybind11, never
// against torch: one wheel works with any torch version. fusedloss/backends/cuda/backend.py fills the argument
// structs from tensors and calls these entry points.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "fusedloss/args.h"
#include "fusedloss/device_guard.h"
#ifdef FUSEDLOSS_EPILOGUE
#include "sm90_epilogue.h"
#endif

namespace py = pybind11;
using namespace fl;

namespace {

// A stand-in for the CUDA runtime's current device, so that the CPU tests check DeviceGuard's restore
// logic (the very template the launchers instantiate with cudaGetDevice / cudaSetDevice).
struct FakeDeviceOps {
  static int current;
  static std::vector<int>* trace;
  static int get(int* device) {
    *device = current;
    return 0;
  }
  static int set(int device) {
    current = device;
    trace->push_back(device);
    return 0;
  }
  static void fail(int, const char* what) { throw std::runtime_error(what); }
};
int FakeDeviceOps::current = 0;
std::vector<int>* FakeDeviceOps::trace = nullptr;

// [device inside the guard, device after it, every device set in between], starting from `current`,
// guarding `target`; `throw_inside` raises inside the guarded scope (the restore must still happen).
std::vector<int> device_guard_trace(int current, int target, bool throw_inside) {
  std::vector<int> sets;
  FakeDeviceOps::current = current;
  FakeDeviceOps::trace = &sets;
  int inside = -1;
  try {
    DeviceGuard<FakeDeviceOps> guard(target);
    inside = FakeDeviceOps::current;
    if (throw_inside) throw std::runtime_error("launch failed");
  } catch (const std::runtime_error&) {
  }
  std::vector<int> out{inside, FakeDeviceOps::current};
  out.insert(out.end(), sets.begin(), sets.end());
  FakeDeviceOps::trace = nullptr;
  return out;
}

#ifdef FUSEDLOSS_EPILOGUE
// The sm_90 epilogue launchers: a failed launch raises RuntimeError with CUTLASS's status and the CUDA error.
template <class Launch, int (*kFn)(const Launch&, char*, size_t)>
void epilogue_call(const Launch& a) {
  char error[512] = "";
  if (kFn(a, error, sizeof(error)) != 0) throw std::runtime_error(std::string("sm_90 epilogue kernel: ") + error);
}

#endif

#define FL_OUTPUT_NAME(id, name) name,
const std::vector<std::string> kOutputNames{FL_OUTPUTS(FL_OUTPUT_NAME)};

}  // namespace

PYBIND11_MODULE(_C, m) {
  // std::invalid_argument (a bad TileArgs, check.h) arrives in Python as ValueError, std::runtime_error
  // (a CUDA error) as RuntimeError: pybind11's standard translations.
  m.doc() = "fusedloss CUDA kernels (statistics tiles, logits gradient) and their host twins";

  py::class_<Transform>(m, "Transform")
      .def(py::init([](float logit_scale, float softcap, float temperature, float chain) {
             return Transform{logit_scale, softcap, temperature, chain};
           }),
           py::arg("logit_scale") = 1.0f, py::arg("softcap") = 0.0f, py::arg("temperature") = 1.0f, py::arg("chain") = 1.0f)
      .def_readwrite("logit_scale", &Transform::logit_scale)
      .def_readwrite("softcap", &Transform::softcap)
      .def_readwrite("temperature", &Transform::temperature)
      .def_readwrite("chain", &Transform::chain);

  py::class_<JsdConsts>(m, "JsdConsts")
      .def(py::init([](float beta, float log_1m_beta, float log_beta) { return JsdConsts{beta, log_1m_beta, log_beta}; }),
           py::arg("beta"), py::arg("log_1m_beta"), py::arg("log_beta"))
      .def_readwrite("beta", &JsdConsts::beta);

  auto tile_args = py::class_<TileArgs>(m, "TileArgs").def(py::init<>());
#define FL_BIND_FIELD(type, name, init) tile_args.def_readwrite(#name, &TileArgs::name);
  FL_TILE_ARGS(FL_BIND_FIELD)
#undef FL_BIND_FIELD

  // The protocol's constants, checked by fusedloss/backends/cuda/backend.py against fusedloss/core/problem.py.
  m.attr("STATE_FIELDS") = int(kStateFields);
  m.attr("NUM_OUTPUTS") = int(kNumOutputs);
  m.attr("OUTPUT_NAMES") = kOutputNames;
  m.attr("NUM_COEFFS") = int(kNumCoeffs);
  m.attr("COEF_INDEX") = std::vector<int>{kCoefOnehot, kCoefConst, kCoefLogq, kCoefKlRev, kCoefTeacherProb,
                                          kCoefLogm, kCoefUniform};

  // Device entry points: `stream` is torch.cuda.current_stream().cuda_stream.
  m.def("fold_tile", &fold_tile, py::arg("args"), py::arg("stream"));
  m.def("jsd_tile", &jsd_tile, py::arg("args"), py::arg("stream"));
  m.def("dx_tile", &dx_tile, py::arg("args"), py::arg("stream"));

  // What the extension's own CUDA runtime sees (availability() in fusedloss/backends/cuda/backend.py).
  m.def("device_count", &cuda_device_count);
  m.def("device_error", []() { return std::string(cuda_device_error()); });
  m.def("runtime_version", &cuda_runtime_version);
  m.def("driver_version", &cuda_driver_version);

  // Host twins over CPU pointers.
  m.def("host_fold_tile", &host_fold_tile, py::arg("args"));
  m.def("host_jsd_tile", &host_jsd_tile, py::arg("args"));
  m.def("host_dx_tile", &host_dx_tile, py::arg("args"));

  // The sm_90 epilogue kernels (csrc/sm90_epilogue.cuh), when the build found the CUTLASS headers.
#ifdef FUSEDLOSS_EPILOGUE
  m.attr("EPILOGUE_KERNELS") = true;
  m.attr("EPILOGUE_TILE") = std::vector<int>{fl_epilogue::kTileM, fl_epilogue::kTileN};
  m.attr("EPILOGUE_COEFF_ROWS") = int(fl_epilogue::kCoeffRows);
  using fl_epilogue::DlogitsLaunch;
  using fl_epilogue::MergeLaunch;
  using fl_epilogue::StatisticsLaunch;
#define FL_RW(cls, name) .def_readwrite(#name, &cls::name)
  py::class_<StatisticsLaunch>(m, "EpilogueStatistics")
      .def(py::init<>()) FL_RW(StatisticsLaunch, hidden) FL_RW(StatisticsLaunch, weight) FL_RW(StatisticsLaunch, n)
      FL_RW(StatisticsLaunch, v) FL_RW(StatisticsLaunch, d) FL_RW(StatisticsLaunch, dtype)
      FL_RW(StatisticsLaunch, entropy) FL_RW(StatisticsLaunch, part_m) FL_RW(StatisticsLaunch, part_t)
      FL_RW(StatisticsLaunch, part_e) FL_RW(StatisticsLaunch, target) FL_RW(StatisticsLaunch, target_logit)
      FL_RW(StatisticsLaunch, logit_scale) FL_RW(StatisticsLaunch, inv_temperature) FL_RW(StatisticsLaunch, stream);
  py::class_<MergeLaunch>(m, "EpilogueMerge")
      .def(py::init<>()) FL_RW(MergeLaunch, part_m) FL_RW(MergeLaunch, part_t) FL_RW(MergeLaunch, part_e)
      FL_RW(MergeLaunch, target_logit) FL_RW(MergeLaunch, out) FL_RW(MergeLaunch, n) FL_RW(MergeLaunch, tiles)
      FL_RW(MergeLaunch, stride) FL_RW(MergeLaunch, entropy) FL_RW(MergeLaunch, target) FL_RW(MergeLaunch, stream);
  py::class_<DlogitsLaunch>(m, "EpilogueDlogits")
      .def(py::init<>()) FL_RW(DlogitsLaunch, hidden) FL_RW(DlogitsLaunch, weight) FL_RW(DlogitsLaunch, n)
      FL_RW(DlogitsLaunch, v) FL_RW(DlogitsLaunch, d) FL_RW(DlogitsLaunch, dtype) FL_RW(DlogitsLaunch, out)
      FL_RW(DlogitsLaunch, ld_out) FL_RW(DlogitsLaunch, target) FL_RW(DlogitsLaunch, target_offset)
      FL_RW(DlogitsLaunch, coeffs) FL_RW(DlogitsLaunch, coeff_stride) FL_RW(DlogitsLaunch, logit_scale)
      FL_RW(DlogitsLaunch, inv_temperature) FL_RW(DlogitsLaunch, chain) FL_RW(DlogitsLaunch, log_q)
      FL_RW(DlogitsLaunch, stream);
#undef FL_RW
  m.def("epilogue_statistics", &epilogue_call<StatisticsLaunch, fl_epilogue::statistics>, py::arg("args"));
  m.def("epilogue_merge", &epilogue_call<MergeLaunch, fl_epilogue::merge>, py::arg("args"));
  m.def("epilogue_dlogits", &epilogue_call<DlogitsLaunch, fl_epilogue::dlogits>, py::arg("args"));
  m.def("epilogue_statistics_info", [](int dtype, bool entropy) {
    std::vector<int> out(fl_epilogue::kInfoFields);
    fl_epilogue::statistics_info(dtype, entropy, out.data());
    return out;
  }, py::arg("dtype"), py::arg("entropy"));
  m.def("epilogue_dlogits_info", [](int dtype) {
    std::vector<int> out(fl_epilogue::kInfoFields);
    fl_epilogue::dlogits_info(dtype, out.data());
    return out;
  }, py::arg("dtype"));
#else
  m.attr("EPILOGUE_KERNELS") = false;
#endif

  // Test hook: DeviceGuard's restore logic on a fake device state (see device_guard_trace above).
  m.def("_device_guard_trace", &device_guard_trace, py::arg("current"), py::arg("target"),
        py::arg("throw_inside") = false);
}
