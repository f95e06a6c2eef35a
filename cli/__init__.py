"""specmesh: speculative-decoding LLM serving as gRPC microservices."""

__version__ = "0.1.0"
