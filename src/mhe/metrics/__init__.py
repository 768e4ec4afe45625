"""Metrics: efficiency (PRR, PEoP) and task metrics."""

from mhe.metrics.efficiency import peop, prr

__all__ = ["peop", "prr"]
