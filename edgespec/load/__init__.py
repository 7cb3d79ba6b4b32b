"""From options to what gets loaded: ``resolve(config, machine, store) -> LoadPlan``."""
from edgespec.load.plan import DrafterPlacement, LoadPlan
from edgespec.load.resolve import each_placement, resolve

__all__ = ["DrafterPlacement", "LoadPlan", "each_placement", "resolve"]
