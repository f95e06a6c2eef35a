"""specmesh: speculative-decoding LLM serving as gRPC microservices.

The namespace root: ``specmesh.client`` (the Python gRPC client), ``specmesh.cluster`` (a local
cluster as processes: ``specmesh up``, the benchmarks), ``specmesh.defaults`` (the built-in demo
pair); the repository's folders are mapped under it (``specmesh.router``, ``specmesh.protocol``,
``specmesh.cli``, ...; pyproject.toml).
"""

__version__ = "0.1.0"
