"""What stands in for the CUDA epilogue kernels where none runs, and the count of the epilogue path's calls: shared
by the epilogue's check (check_epilogue.py), the cases' check (check_cases.py) and
tests/contract/test_cuda_epilogue_twins.py.

``HostTwins`` runs fusedloss/backends/cuda/epilogue.py's three launches over CPU tensors: the fp32 product, then the
host twins of csrc/epilogue_host.cpp tile by tile.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


class HostTwins:
    """fusedloss/backends/cuda/epilogue.py's three launches over CPU tensors: the fp32 product, then the host twins of
    csrc/epilogue_host.cpp tile by tile. ``fault``: scale the entropy partials (the checks must catch it)."""

    def __init__(self, lib: Path, fault: float = 1.0):
        so = ctypes.CDLL(str(lib))
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        so.fl_epilogue_fold_tile.argtypes = [p, i32, i32, i32, f32, f32, i32, p, p, p, p, p]
        so.fl_epilogue_finalize.argtypes = [p, p, p, i32, i32, i64, p, p, i32, p]
        so.fl_epilogue_dlogits.argtypes = [p, i32, i32, i64, p, p, f32, f32, f32, i32, i32, p]
        self.so, self.fault = so, fault

    @staticmethod
    def compile(folder: Path) -> Path:
        cxx = shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            raise FileNotFoundError("no host C++ compiler for the epilogue twins")
        lib = folder / "epilogue_twins.so"
        subprocess.run([cxx, "-O2", "-std=c++17", "-fPIC", "-shared", f"-I{ROOT / 'csrc'}",
                        str(ROOT / "csrc" / "epilogue_host.cpp"), "-o", str(lib)], check=True)
        return lib

    def statistics(self, p, part, targets, target_logit, scale):
        import torch

        from fusedloss.backends.cuda.epilogue import TILE_N as tn

        n, v = p.hidden.shape[0], p.weight.shape[0]
        acc = p.hidden.float() @ p.weight.float().T
        for j in range(part.shape[1]):
            v0, v1 = j * tn, min(v, (j + 1) * tn)
            tile = torch.zeros((n, tn), dtype=torch.float32)
            tile[:, : v1 - v0] = acc[:, v0:v1]
            rel = torch.where((targets >= v0) & (targets < v1), targets - v0, torch.full_like(targets, -1))
            outs = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
            self.so.fl_epilogue_fold_tile(_ptr(tile), n, tn, v1 - v0, *scale, int(p.want_entropy), _ptr(rel),
                                          *map(_ptr, outs), _ptr(target_logit))
            outs[2] *= self.fault
            for k in range(part.shape[0]):
                part[k, j, :n] = outs[k]

    def merge(self, part, target_logit, out, entropy, targets):
        e = part[2] if entropy else part[1]
        self.so.fl_epilogue_finalize(_ptr(part[0]), _ptr(part[1]), _ptr(e), out.shape[1], part.shape[1],
                                     part.shape[2], _ptr(target_logit), None if targets is None else _ptr(targets),
                                     int(entropy), _ptr(out))

    def dlogits(self, h, w, out, targets, v0, rows, scale, chain, log_q):
        import torch

        acc = (h.float() @ w.float().T).contiguous()
        tmp = torch.empty(acc.shape, dtype=out.dtype)
        code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[out.dtype]
        self.so.fl_epilogue_dlogits(_ptr(acc), acc.shape[0], acc.shape[1], v0, _ptr(targets.contiguous()),
                                    _ptr(rows), *scale, chain, int(log_q), code, _ptr(tmp))
        out.copy_(tmp)



CALLS = {"forward": 0, "backward": 0}  # the epilogue path's entry points, counted (main wraps them)


def count_calls(epilogue) -> None:
    """Wrap the epilogue path's entry points so that each call counts once in CALLS, however many checks of one
    process ask for the count (the cases' check and this one)."""
    for name, attr in (("forward", "forward_statistics"), ("backward", "backward_gradients")):
        fn = getattr(epilogue, attr)
        if getattr(fn, "counts_calls", False):
            continue

        def counted(*a, _fn=fn, _name=name, **k):
            CALLS[_name] += 1
            return _fn(*a, **k)

        counted.counts_calls = True
        setattr(epilogue, attr, counted)
