"""Where decode time goes: attention, routed-expert compute, waiting for the drives, and the rest.

The model's layers add to one process-wide `TimeSplit` (`SPLIT`); the runner reads differences of snapshots around a
turn. Timing is a few perf_counter calls per layer and forward, so it stays on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass
class TimeSplit:
    attention: float = 0.0
    moe: float = 0.0  # routed experts and shared experts of MoE layers, drive waits included

    def since(self, earlier: TimeSplit) -> TimeSplit:
        return TimeSplit(self.attention - earlier.attention, self.moe - earlier.moe)

    def snapshot(self) -> TimeSplit:
        return replace(self)


SPLIT = TimeSplit()
clock = time.perf_counter
