"""The backends: ``torch`` (portable tensor ops, any device), ``triton`` (Triton kernels) and ``cuda`` (cuBLAS
products and the kernels of ``csrc/``). Each GPU backend is a pure ``plan.py`` (shapes, tiles, chunks, the
path) beside the ``backend.py`` that allocates and launches; ``gpu.py`` is what they share. The registry
(``core/registry.py``) imports them lazily, so a missing Triton or an unbuilt extension never breaks
``import fusedloss`` (docs/design.md, "The backends wing")."""
