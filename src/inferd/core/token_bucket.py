"""A token bucket that may go below zero: a tenant's request rate and token budget (core/tenant.py)."""

from __future__ import annotations


class Bucket:
    """``capacity`` at most, ``rate`` per second back; may go below zero by one request (the debt model:
    core/tenant.py)."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity, self.rate, self.level, self.stamp = capacity, rate, capacity, now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def give_back(self, amount: float, now: float) -> None:
        """A charge (or reservation) returned: the level rises by it, never past ``capacity``."""
        self.level = min(self.capacity, self.refill(now) + amount)

    def wait(self, now: float, need: float = 0.0) -> float:
        """Seconds until the level is above ``need`` (0: it is)."""
        level = self.refill(now)
        return 0.0 if level > need else (need - level) / self.rate + 1e-3

    def reset_in(self, now: float) -> float:
        """Seconds until it is full again."""
        return max(0.0, self.capacity - self.refill(now)) / self.rate


def carried(old: Bucket | None, new: Bucket, now: float) -> Bucket:
    """``new`` at ``old``'s level now (a fresh bucket starts full)."""
    if old is not None:
        new.level = min(new.capacity, old.refill(now))
    return new
