"""Rank layout (pure arithmetic) and the ProcessGroups object built from it."""

from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout

__all__ = ["ProcessGroups", "RankLayout"]
