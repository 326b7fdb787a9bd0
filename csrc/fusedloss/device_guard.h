// Makes a device current for the lifetime of a scope and restores the caller's afterwards, also when the
// scope throws. The extension links its own CUDA runtime, whose cudaSetDevice changes the thread's current
// device for torch as well (both talk to the same driver context): a launch for tensors on cuda:1 must not
// leave a caller on cuda:0 allocating on cuda:1.
//
// `Ops` supplies `static int get(int* device)` and `static int set(int device)` (0 = success) and
// `static void fail(int code, const char* what)` (throws); kernels.cu binds them to the CUDA runtime, and
// bindings.cpp to a recording fake so that the CPU test suite checks the restore logic itself.
#pragma once

namespace fl {

template <typename Ops>
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const int err = Ops::get(&previous_);
    if (err != 0) Ops::fail(err, "cudaGetDevice");
    if (previous_ != device) {
      const int set_err = Ops::set(device);
      if (set_err != 0) Ops::fail(set_err, "cudaSetDevice");
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) Ops::set(previous_);  // a destructor must not throw; the launch already reported
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace fl
