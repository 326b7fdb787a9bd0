"""The per-token statistics core (docs/design.md, "The statistics problem"): one problem definition, one
differentiable op, one implementation per backend."""

from .problem import LogitTransform, Statistics, StatsProblem
from .statistics import TeacherHead, dz_coefficients, token_statistics

__all__ = ["LogitTransform", "Statistics", "StatsProblem", "TeacherHead", "dz_coefficients", "token_statistics"]
