"""A per-step metric smoothed across steps, as adaptive components keep it (and checkpoint it)."""

from __future__ import annotations


class SmoothedMetric:
    """An exponential moving average of a metric that also remembers the metric's first value.

    ``value = smoothing * value + (1 - smoothing) * x`` after the first ``x``; a missing or NaN
    ``x`` (a step where every sample was dropped) is skipped.
    """

    def __init__(self, smoothing: float) -> None:
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing={smoothing}: use a value in [0, 1)")
        self.smoothing = smoothing
        self.first: float | None = None
        self.value: float | None = None

    def update(self, x: float | None) -> bool:
        """Fold in this step's ``x``; False when it was missing or NaN (nothing changed)."""
        if x is None or x != x:
            return False
        if self.value is None:
            self.first = self.value = x
        else:
            self.value = self.smoothing * self.value + (1 - self.smoothing) * x
        return True

    def state_dict(self) -> dict:
        return {"first": self.first, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.first, self.value = state["first"], state["value"]
