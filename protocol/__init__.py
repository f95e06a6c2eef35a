"""The torch-free contracts every process shares: what crosses a service boundary, and the
values a client sets. The router and the CLI's router path import only this package and `rpc`;
each model service converts these to tensors once, at its edge.

    errors.py     the errors a caller can act on, one gRPC status each
    sampling.py   `SamplingParams`, validated once at the public API
    features.py   what a draft reads from the target per token (`FeatureSpec`, `AuxLayers`)
    trees.py      `DraftTree`: tokens + parent indices, nothing derived
    steps.py      each service's step inputs and outputs (`PrefillInput`, `VerifyInput`,
                  `StepOutput`, `ExtendInput`, `DraftStepResult`, `Logprob`, infos)
    codec.py      the one bytes codec: `RowBlock`, HiddenStates chunks, message-size limits
    config.py     the services' frozen configs (`TargetConfig`, `DraftConfig`, `SpecParams`)
    images.py     image limits checked before anything is decoded
"""
