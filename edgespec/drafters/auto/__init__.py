"""The auto drafter: its cost model (calibration) and per-step policy."""
from edgespec.drafters.auto.drafter import AutoDrafter

__all__ = ["AutoDrafter"]
