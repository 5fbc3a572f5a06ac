"""Data-parallel gradient reduction and the per-step gradient finalization."""
