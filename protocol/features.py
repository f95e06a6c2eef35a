"""What a draft reads from the target per token, named once for every service and the router.

`Feature` is the one vocabulary (the proto enum `specmesh.v1.Feature` mirrors it); `AuxLayers`
names EAGLE-3's captured layers with their numbering made explicit; `FeatureSpec` is what a
draft needs and what the router's handshake asks a target for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Feature(Enum):
    NONE = "none"  # standalone / n-gram drafts, or no draft
    AUX_HIDDEN = "aux_hidden"  # EAGLE-3: inputs of the aux layers, concatenated
    HIDDEN = "hidden"  # EAGLE-1/2: final hidden state after the final norm
    HIDDEN_PRE_NORM = "hidden_pre_norm"  # MTP: final hidden state before the final norm

    @property
    def wire_field(self) -> str | None:
        """The `HiddenStates` tensor field that carries this feature."""
        return {Feature.AUX_HIDDEN: "aux_hidden", Feature.NONE: None}.get(self, "hidden")


@dataclass(frozen=True)
class AuxLayers:
    """Which residual-stream states to capture for EAGLE-3, with the numbering made explicit.

    ``convention="input"``: id i is the input of layer i (SGLang's default ``[2, L//2, L-3]``,
    transformers ``hidden_states[i]``). ``convention="output"``: id i is the output of layer i (the
    SpecForge / SGLang-config numbering), i.e. the input of layer i + 1. A capture point equal to
    ``num_layers`` is the last layer's output, before the final norm.
    """

    layer_ids: tuple[int, ...]
    convention: str = "input"

    def capture_points(self, num_layers: int) -> tuple[int, ...]:
        if self.convention not in ("input", "output"):
            raise ValueError(
                f"aux layer convention must be 'input' or 'output', got {self.convention!r}"
            )
        shift = 0 if self.convention == "input" else 1
        points = tuple(i + shift for i in self.layer_ids)
        bad = [p for p in points if not 0 <= p <= num_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {list(self.layer_ids)} ({self.convention} convention) fall outside "
                f"a {num_layers}-layer model"
            )
        return points

    @staticmethod
    def default(num_layers: int) -> AuxLayers:
        return AuxLayers((2, num_layers // 2, num_layers - 3), "input")


@dataclass(frozen=True)
class FeatureSpec:
    """What a draft reads per token; ``aux`` only for `Feature.AUX_HIDDEN` (None = the target's
    default layers)."""

    feature: Feature = Feature.NONE
    aux: AuxLayers | None = None

    def describe(self) -> str:
        if self.feature is not Feature.AUX_HIDDEN or self.aux is None:
            return self.feature.value
        return f"aux_hidden of layers {list(self.aux.layer_ids)} ({self.aux.convention} numbering)"


def draft_needs(needs: list[FeatureSpec]) -> FeatureSpec:
    """What every target must return per token for these drafts: one thing, or a refusal that
    says why (a target captures one set of aux layers and returns one feature per stream)."""
    distinct = list(dict.fromkeys(needs))
    if len(distinct) > 1:
        raise ValueError(
            "the draft replicas read different target features ("
            + "; ".join(n.describe() for n in distinct)
            + "); serve one kind of draft per router"
        )
    return distinct[0] if distinct else FeatureSpec()
