"""The per-token statistics core (docs/design.md, "The statistics problem"): one problem definition, one
differentiable op, one implementation per backend."""

from .problem import LogitTransform, Statistics, StatsProblem
from .statistics import TeacherHead, column_statistics, dz_coefficients, token_statistics

__all__ = ["LogitTransform", "Statistics", "StatsProblem", "TeacherHead", "column_statistics", "dz_coefficients",
           "token_statistics"]
