"""Rank layout (pure arithmetic), the layer placement over pipeline stages (pure arithmetic) and the
ProcessGroups object built from the layout. ``ProcessGroups`` and ``RankLayout`` are imported on first
use, so that the pure modules (placement.py, stage_layout.py) stay importable without torch."""

from typing import Any

__all__ = ["ProcessGroups", "RankLayout"]


def __getattr__(name: str) -> Any:
    if name == "ProcessGroups":
        from megalite.parallel.groups import ProcessGroups

        return ProcessGroups
    if name == "RankLayout":
        from megalite.parallel.layout import RankLayout

        return RankLayout
    raise AttributeError(f"module 'megalite.parallel' has no attribute {name!r}")
