"""--profile: a torch.profiler window over iterations [--profile-step-start, --profile-step-end),
written as one Chrome/Perfetto trace per rank."""

from __future__ import annotations

import os

import torch

from megalite import device


class StepProfiler:
    def __init__(self, enabled: bool, start: int, end: int, out_dir: str, rank: int, ranks: list[int] | None
                 ) -> None:
        self.enabled = enabled and (not ranks or rank in ranks)
        self.start, self.end, self.out_dir, self.rank = start, end, out_dir, rank
        self.prof: torch.profiler.profile | None = None

    def before(self, iteration: int) -> None:
        """Call before running iteration ``iteration`` (0-based count of steps done)."""
        if self.enabled and iteration == self.start and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if device.has_cuda():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, with_stack=False)
            self.prof.__enter__()

    def after(self, iteration: int) -> str | None:
        """Call after the step; returns the trace path when the window closes."""
        if self.prof is None or iteration < self.end:
            return None
        device.synchronize()
        self.prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"trace_rank{self.rank:05d}.json")
        self.prof.export_chrome_trace(path)
        self.prof = None
        self.enabled = False
        return path
