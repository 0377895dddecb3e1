"""The KV pull throughput an engine measures for its migrated-in requests (CascadeInfer, paper 000, §4.4: a
request won in bid-ask starts no earlier than its KV over the target's transfer throughput; issue 16, item 6).

Owns: `TransferRate`, an exponentially weighted mean of the throughput (bytes / seconds) of the recent pulls
a backend measured, pushed on WatchState as `EngineStats.transfer_bytes_per_s`.
Must not: read clocks (a pull's duration comes in as seconds), do I/O, or decide what a pull is (the sim
backend reports its modelled pulls, the vLLM backend NIXL's measured READs).
"""

from __future__ import annotations

DEFAULT_WEIGHT = 0.2  # the newest pull's weight: about the last 5 pulls count


class TransferRate:
    """Pulls in, their mean throughput out (bytes/s; 0.0 before the first pull). The first pull sets the
    mean; each later one moves it by `weight` of the difference."""

    __slots__ = ("_weight", "_bytes_per_s", "pulls")

    def __init__(self, weight: float = DEFAULT_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self._bytes_per_s = 0.0
        self.pulls = 0  # pulls counted

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    def observe(self, kv_bytes: float, seconds: float) -> bool:
        """One pull of `kv_bytes` that took `seconds`; whether it counted (both positive and finite)."""
        if not (0.0 < kv_bytes < float("inf") and 0.0 < seconds < float("inf")):
            return False
        rate = kv_bytes / seconds
        self.pulls += 1
        if self.pulls == 1:
            self._bytes_per_s = rate
        else:
            self._bytes_per_s += self._weight * (rate - self._bytes_per_s)
        return True
