// Python bindings of fusedloss._C. Pointers, shapes, strides, dtype codes and the CUDA stream travel as
// plain integers, so the extension links only against the CUDA runtime (statically) and pybind11, never
// against torch: one wheel works with any torch version. fusedloss/cuda/backend.py fills the argument
// structs from tensors and calls these entry points.
#include <pybind11/pybind11.h>

#include "fusedloss/args.h"

namespace py = pybind11;
using namespace fl;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedloss CUDA kernels (statistics tiles, logits gradient, GRPO/DPO per-token math) and their host twins";

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

  py::class_<TileArgs>(m, "TileArgs")
      .def(py::init<>())
      .def_readwrite("x", &TileArgs::x)
      .def_readwrite("xt", &TileArgs::xt)
      .def_readwrite("dtype", &TileArgs::dtype)
      .def_readwrite("ld", &TileArgs::ld)
      .def_readwrite("rows", &TileArgs::rows)
      .def_readwrite("cols", &TileArgs::cols)
      .def_readwrite("v0", &TileArgs::v0)
      .def_readwrite("bias", &TileArgs::bias)
      .def_readwrite("teacher_bias", &TileArgs::teacher_bias)
      .def_readwrite("bias_dtype", &TileArgs::bias_dtype)
      .def_readwrite("teacher_bias_dtype", &TileArgs::teacher_bias_dtype)
      .def_readwrite("tf", &TileArgs::tf)
      .def_readwrite("teacher_tf", &TileArgs::teacher_tf)
      .def_readwrite("targets", &TileArgs::targets)
      .def_readwrite("want_entropy", &TileArgs::want_entropy)
      .def_readwrite("want_kl_rev", &TileArgs::want_kl_rev)
      .def_readwrite("want_kl_fwd", &TileArgs::want_kl_fwd)
      .def_readwrite("want_mean_logit", &TileArgs::want_mean_logit)
      .def_readwrite("want_extras", &TileArgs::want_extras)
      .def_readwrite("vocab", &TileArgs::vocab)
      .def_readwrite("first", &TileArgs::first)
      .def_readwrite("last", &TileArgs::last)
      .def_readwrite("state", &TileArgs::state)
      .def_readwrite("state_stride", &TileArgs::state_stride)
      .def_readwrite("out", &TileArgs::out)
      .def_readwrite("out_stride", &TileArgs::out_stride)
      .def_readwrite("jsd", &TileArgs::jsd)
      .def_readwrite("has_jsd", &TileArgs::has_jsd)
      .def_readwrite("jsd_acc", &TileArgs::jsd_acc)
      .def_readwrite("jsd_acc_stride", &TileArgs::jsd_acc_stride)
      .def_readwrite("coeffs", &TileArgs::coeffs)
      .def_readwrite("coeff_stride", &TileArgs::coeff_stride)
      .def_readwrite("dx", &TileArgs::dx)
      .def_readwrite("dx_dtype", &TileArgs::dx_dtype)
      .def_readwrite("dx_ld", &TileArgs::dx_ld)
      .def_readwrite("device", &TileArgs::device);

  // Constants the loss modules form from Python floats are formed here in double, as Python does.
  py::class_<GrpoParams>(m, "GrpoParams")
      .def(py::init([](int kind, double eps_low, double eps_high, bool has_delta, double delta, double beta) {
             return GrpoParams{kind, eps_low, eps_high, has_delta ? 1 : 0, delta, beta, 1.0 - eps_low, 1.0 + eps_high};
           }),
           py::arg("kind"), py::arg("eps_low"), py::arg("eps_high"), py::arg("has_delta"), py::arg("delta"), py::arg("beta"));

  py::class_<GrpoArgs>(m, "GrpoArgs")
      .def(py::init<>())
      .def_readwrite("n", &GrpoArgs::n)
      .def_readwrite("dtype", &GrpoArgs::dtype)
      .def_readwrite("logp", &GrpoArgs::logp)
      .def_readwrite("old_logp", &GrpoArgs::old_logp)
      .def_readwrite("logratio", &GrpoArgs::logratio)
      .def_readwrite("adv", &GrpoArgs::adv)
      .def_readwrite("mask", &GrpoArgs::mask)
      .def_readwrite("iw", &GrpoArgs::iw)
      .def_readwrite("ref", &GrpoArgs::ref)
      .def_readwrite("weight", &GrpoArgs::weight)
      .def_readwrite("params", &GrpoArgs::params)
      .def_readwrite("out", &GrpoArgs::out)
      .def_readwrite("device", &GrpoArgs::device);

  py::class_<DpoParams>(m, "DpoParams")
      .def(py::init([](int kind, double beta, double label_smoothing) {
             return DpoParams{kind, beta, label_smoothing, 1.0 - label_smoothing, 1.0 / (2.0 * beta),
                              1.0 - 2.0 * label_smoothing};
           }),
           py::arg("kind"), py::arg("beta"), py::arg("label_smoothing"));

  py::class_<DpoArgs>(m, "DpoArgs")
      .def(py::init<>())
      .def_readwrite("n", &DpoArgs::n)
      .def_readwrite("dtype", &DpoArgs::dtype)
      .def_readwrite("logp_c", &DpoArgs::logp_c)
      .def_readwrite("logp_r", &DpoArgs::logp_r)
      .def_readwrite("ref_c", &DpoArgs::ref_c)
      .def_readwrite("ref_r", &DpoArgs::ref_r)
      .def_readwrite("n_c", &DpoArgs::n_c)
      .def_readwrite("n_r", &DpoArgs::n_r)
      .def_readwrite("params", &DpoArgs::params)
      .def_readwrite("out", &DpoArgs::out)
      .def_readwrite("device", &DpoArgs::device);

  m.attr("STATE_FIELDS") = int(kStateFields);
  m.attr("NUM_OUTPUTS") = int(kNumOutputs);
  m.attr("FOLD_THREADS") = kFoldThreads;
  m.attr("GRPO_OUTPUTS") = kGrpoOutputs;

  // Device entry points: `stream` is torch.cuda.current_stream().cuda_stream.
  m.def("fold_tile", &fold_tile, py::arg("args"), py::arg("stream"));
  m.def("jsd_tile", &jsd_tile, py::arg("args"), py::arg("stream"));
  m.def("dx_tile", &dx_tile, py::arg("args"), py::arg("stream"));
  m.def("grpo_tokens", &grpo_tokens, py::arg("args"), py::arg("stream"));
  m.def("dpo_pairs", &dpo_pairs, py::arg("args"), py::arg("stream"));
  m.def("device_count", &cuda_device_count);

  // Host twins over CPU pointers.
  m.def("host_fold_tile", &host_fold_tile, py::arg("args"));
  m.def("host_jsd_tile", &host_jsd_tile, py::arg("args"));
  m.def("host_dx_tile", &host_dx_tile, py::arg("args"));
  m.def("host_grpo_tokens", &host_grpo_tokens, py::arg("args"));
  m.def("host_dpo_pairs", &host_dpo_pairs, py::arg("args"));
}
