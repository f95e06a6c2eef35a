"""Every Kubernetes manifest passes `kubernetes-validate --strict` against the newest Kubernetes
schema it bundles (field names, types, required fields; no unknown field), offline; what a
schema cannot say (commands, ports, probes against the real CLI) is `test_deploy.py`'s."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _k8s_schema_version() -> str:
    """The newest Kubernetes version whose schemas kubernetes-validate bundles (no download)."""
    version = kubernetes_validate.latest_version()
    major_minor = tuple(int(n) for n in version.split(".")[:2])
    assert major_minor >= (1, 30), f"kubernetes-validate bundles schemas up to {version} only"
    return version


def _check_schemas(k8s: list[dict]) -> None:
    version = _k8s_schema_version()
    for doc in k8s:  # a kind without a bundled schema raises too: nothing is skipped
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_manifests_pass_the_strict_schema(k8s: list[dict]) -> None:
    _check_schemas(k8s)


SCHEMA_MISTAKES = {
    "unknown field": lambda c: c["ports"][0].update({"containerPorts": 1}),
    "wrong type": lambda c: c["ports"][0].update({"containerPort": "50052"}),
    "missing required": lambda c: c.pop("name"),
}


@pytest.mark.parametrize("mistake", SCHEMA_MISTAKES)
def test_k8s_schema_check_catches_a_malformed_field(k8s: list[dict], mistake: str) -> None:
    """Each mistake, planted in the target's container in a copy, fails the schema check."""
    docs = copy.deepcopy(k8s)
    (target,) = [d for d in docs if d["kind"] == "StatefulSet"]
    SCHEMA_MISTAKES[mistake](target["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        _check_schemas(docs)
