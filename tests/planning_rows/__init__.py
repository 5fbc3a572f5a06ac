"""The published runs the planner is checked against, and the calibration of its one throughput-fitted
constant: test apparatus, not runtime (a run and tools/plan.py never read them; docs/planning.md).

- ``published.py``: the development rows (seen) and the MoE parameter counts;
- ``heldout.py``, ``heldout_v5.py``: the held-out rounds' rows (rounds 1-4, round 5);
- ``calibration.py``: each GPU's sustained share, fitted on the seen rows (hardware.py holds the result);
- ``first_runs.csv``: each held-out row's error at its round's first and only run, as docs/planning.md
  records it: the figures megalite/planning/accuracy.py prints with every estimate.
"""
