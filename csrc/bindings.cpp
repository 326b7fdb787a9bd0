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

  // What the extension's own CUDA runtime sees (availability() in backend.py).
  m.def("device_count", &cuda_device_count);
  m.def("device_error", []() { return std::string(cuda_device_error()); });
  m.def("runtime_version", &cuda_runtime_version);
  m.def("driver_version", &cuda_driver_version);

  // Host twins over CPU pointers.
  m.def("host_fold_tile", &host_fold_tile, py::arg("args"));
  m.def("host_jsd_tile", &host_jsd_tile, py::arg("args"));
  m.def("host_dx_tile", &host_dx_tile, py::arg("args"));

  // Test hook: DeviceGuard's restore logic on a fake device state (see device_guard_trace above).
  m.def("_device_guard_trace", &device_guard_trace, py::arg("current"), py::arg("target"),
        py::arg("throw_inside") = false);
}
