"""The torch-free contracts every process shares: what crosses a service boundary, and the
values a client sets. The router and the CLI's router path import only this package and `rpc`;
each model service converts these to tensors once, at its edge.

    errors.py     the errors a caller can act on, one gRPC status each
    features.py   what a draft reads from the target per token (`FeatureSpec`, `AuxLayers`)
    sampling.py   `SamplingParams`, validated once at the public API
"""
