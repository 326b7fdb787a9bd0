"""Triton kernels of the statistics core: one kernel per file, named for what it computes, sharing
the tile math of ``tile_math``. ``backend`` implements the backend protocol of
``fusedloss/core/problem.py`` on top of them. Importing this package does not import Triton."""
