"""Build script. The pure-Python package always builds; the CUDA extension ``fusedloss._C`` is added by
the CUDA backend's build step (see csrc/), steered by FUSEDLOSS_CUDA (SPEC section 3):
0 skips it, 1 requires it, unset builds it when nvcc is found. Never imports torch."""

from setuptools import setup

setup()
