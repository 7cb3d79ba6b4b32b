"""Manifests of the models edgespec knows by name (one JSON file each), installed as data."""
