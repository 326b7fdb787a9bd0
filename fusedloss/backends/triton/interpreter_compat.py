"""What Triton's CPU interpreter (``TRITON_INTERPRET=1``, the test suite's Triton) needs from its surroundings
to run the kernels: applied by ``backend._kernels`` before the kernels are first defined."""

from __future__ import annotations


def numpy_compat() -> None:
    """Triton's interpreter (3.4 to 3.6 at least) turns a scalar tensor into a Python int with
    ``int(array)``, which NumPy >= 2.4 rejects for its 1-element arrays, so every loop with a runtime bound
    (``range(0, D, BLOCK_K)``) fails there. Wrap the interpreter's tensor patch to convert with ``.item()``."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fusedloss_compat", False):
        return

    def index(self):
        return int(self.handle.data.item())

    # Triton >= 3.6 patches through a scope that restores the class afterwards; older ones set attributes.
    def patched(tensor, *scope):
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._fusedloss_compat = True
    interpreter._patch_lang_tensor = patched
