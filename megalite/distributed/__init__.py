"""Joining torch.distributed (start-up of a run), data-parallel gradient reduction, and the per-step
gradient finalization."""
