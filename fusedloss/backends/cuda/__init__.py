"""CUDA backend of the statistics core: cuBLAS products and the kernels of ``csrc/`` (the extension
``fusedloss._C``). ``backend`` implements the protocol of ``fusedloss/core/problem.py``; importing this
package never fails, even when the extension was not built (``backend.availability()`` says why)."""
