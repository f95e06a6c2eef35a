"""The router's Prometheus metrics (served at ``/metrics`` on its HTTP port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

REGISTRY = CollectorRegistry()  # the router's own: tests and in-process engines do not collide
