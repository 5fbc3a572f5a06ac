"""The layout planner: per-rank memory and step time of a layout on a cluster, and a search over layouts.

Pure arithmetic on the config dataclasses (no torch, no process group), so that ``tools/plan.py`` and
``pretrain_gpt.py --dry-run`` answer in well under a second. One function per memory or time term
(``memory.py``, ``timing.py``), so that a feature that lands (MoE, ZeRO stages) adds its own term.
"""
