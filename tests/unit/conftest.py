"""Fixtures of the unit tests' own helpers."""

from up_harness import started  # noqa: F401  (`specmesh up` without processes)
