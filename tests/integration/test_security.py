"""Hardening, in process on loopback with real certificates (`tests/certs.py`, openssl):

- the whole cluster over TLS (mTLS between the router and its services) gives transformers'
  greedy output, and the router's public port takes a TLS client without a client certificate;
- target and draft refuse plaintext callers, callers without a client certificate and callers
  whose certificate another CA signed; GetInfo reports model names, never paths;
- the router's API key: missing or wrong is UNAUTHENTICATED (Generate and GetInfo), health and
  reflection answer without it, the right key works over TLS and (as metadata) over plaintext;
- a server certificate rewritten on disk is served at the next handshake, no restart;
- a second server on a live port fails; bad TLS files fail at start with the flag and path.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from certs import Certs, issue, make_ca, make_certs
from conftest import assert_accepted
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    count_batches,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.rpc.health import check_health
from specmesh.rpc.security import TlsFiles, client_channel
from specmesh.rpc.service_common import ServiceHost
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2_grpc

KEY = "s3cret-key"
CODE = grpc.StatusCode
STUBS = {"target": target_pb2_grpc.TargetStub, "draft": draft_pb2_grpc.DraftStub}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca_client(certs: Certs) -> tuple[Path, Path]:
    """A client certificate that a CA the services do not trust signed."""
    directory = certs.ca.parent
    return issue(directory, "stranger", make_ca(directory, "other-ca"), "clientAuth")


@pytest.fixture(scope="module")
def secure(copy_dir: Path, certs: Certs, oracle):
    """Target and draft requiring client certificates, a TLS router with an API key; the draft
    predicts its target (`copy_drafts`), so rounds accept draft tokens."""
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    tls = TlsFiles(str(certs.service_cert), str(certs.service_key), str(certs.ca))
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir)), tls=tls))
    eagle3 = load_draft(DraftConfig("eagle3", draft_dir, target_dir, SPEC))
    draft = loop.run(serve_draft(eagle3, tls=tls))
    router = loop.run(serve_router(target, draft, tls=tls, api_key=KEY))
    addr = lambda port: f"127.0.0.1:{port}"
    yield SimpleNamespace(
        loop=loop,
        target=addr(target.host.port),
        draft=addr(draft.host.port),
        drafted=count_batches(draft),
        router=addr(router.port),
        expected=lambda prompt, n: oracle(target_dir, prompt, n),
        target_dir=target_dir,
        dir_names={"target": "target", "draft": "eagle3"},
        client_tls=TlsFiles(str(certs.client_cert), str(certs.client_key), str(certs.ca)),
        public_tls=TlsFiles(ca_file=str(certs.ca)),  # verifies the router, no client cert
    )
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def get_info(address: str, kind: str, tls: TlsFiles | None = None):
    with client_channel(address, tls) as channel:
        return STUBS[kind](channel).GetInfo(generation_pb2.InfoRequest(), timeout=5)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# -- TLS ---------------------------------------------------------------------------------------
def test_cluster_over_mtls_matches_transformers(secure) -> None:
    prompt, n = [5, 6, 7, 8, 9], 16
    with GenerationClient(secure.router, api_key=KEY, tls=secure.public_tls) as client:
        ids, _, last = collect(client.generate(prompt_token_ids=prompt, sampling=greedy(n)))
        assert ids == secure.expected(prompt, n)
        assert secure.drafted["batches"] > 0  # the router reached the draft over mTLS too
        assert_accepted([last.stats])
        text_ids, text, _ = collect(client.generate("def add(a, b):", sampling=greedy(4)))
        assert len(text_ids) == 4 and text  # --tokenizer, not the target's reported path
        info = client.info()
    assert info.model_name == info.model_path == "target"  # a name, never a path
    assert (info.num_target_replicas, info.num_draft_replicas) == (1, 1)


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_model_services_refuse_callers_without_a_trusted_client_certificate(
    secure, certs: Certs, other_ca_client, kind: str
) -> None:
    address = getattr(secure, kind)
    stranger = TlsFiles(*map(str, other_ca_client), str(certs.ca))
    for tls in (None, secure.public_tls, stranger):  # plaintext, no client cert, untrusted CA
        assert refusal(lambda tls=tls: get_info(address, kind, tls)).code() == CODE.UNAVAILABLE
        assert not check_health(address, "", timeout_s=2.0, tls=tls)
    info = get_info(address, kind, secure.client_tls)
    assert info.model_path == secure.dir_names[kind]  # the checkpoint dir's name only
    assert check_health(address, f"specmesh.v1.{kind.title()}", tls=secure.client_tls)


def test_router_public_port_is_tls_without_client_certificates(secure) -> None:
    assert check_health(secure.router, "specmesh.v1.Generation", tls=secure.public_tls)
    assert not check_health(secure.router, "", timeout_s=2.0)  # plaintext gets nowhere
    with GenerationClient(secure.router, api_key=KEY) as plaintext:
        assert refusal(plaintext.info).code() == CODE.UNAVAILABLE


# -- API key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_missing_or_wrong_is_unauthenticated(secure, key: str | None) -> None:
    with GenerationClient(secure.router, api_key=key, tls=secure.public_tls) as client:
        for call in (client.info, lambda: list(client.generate(prompt_token_ids=[5, 6]))):
            e = refusal(call)
            assert e.code() == CODE.UNAUTHENTICATED
            assert ("missing" if key is None else "invalid") in e.details()
            assert "authorization: Bearer" in e.details()
        with client_channel(secure.router, secure.public_tls, key) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            listed = {s.name for s in next(reflect).list_services_response.service}
            assert "specmesh.v1.Generation" in listed


def test_api_key_over_plaintext_travels_as_metadata(secure) -> None:
    """Without TLS grpc refuses call credentials: the client sends the key as metadata."""
    loop = secure.loop
    target = loop.run(serve_target(TargetRuntime(TargetConfig(secure.target_dir))))
    router = loop.run(serve_router(target, api_key=KEY))
    address = f"127.0.0.1:{router.port}"
    try:
        with GenerationClient(address) as anonymous:
            assert refusal(anonymous.info).code() == CODE.UNAUTHENTICATED
        with GenerationClient(address, api_key=KEY) as client:
            ids, _, _ = collect(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(6)))
            assert ids == secure.expected([5, 6, 7], 6)
        with grpc.insecure_channel(address) as channel:
            info = generation_pb2_grpc.GenerationStub(channel).GetInfo
            lowercase = [("authorization", f"bearer {KEY}")]  # the scheme is case-insensitive
            assert info(generation_pb2.InfoRequest(), metadata=lowercase).vocab_size
            basic = [("authorization", f"Basic {KEY}")]  # the right key in another scheme
            e = refusal(lambda: info(generation_pb2.InfoRequest(), metadata=basic))
            assert e.code() == CODE.UNAUTHENTICATED and "invalid API key" in e.details()
    finally:
        loop.run(router.stop(0.5))
        loop.run(target.host.shutdown(0.5))


# -- certificate reload, exclusive ports, file checks ------------------------------------------
def test_server_certificate_is_reloaded_when_its_files_change(secure, tmp_path: Path) -> None:
    """Rewrite the served certificate, key and CA with ones from a new CA: the next handshake
    serves them; clients of the old CA are refused, clients of the new one get in."""
    old = make_certs(tmp_path / "old")
    new = make_certs(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    for src, name in ((old.service_cert, "cert"), (old.service_key, "key"), (old.ca, "ca")):
        shutil.copy(src, live / name)
    served = TlsFiles(str(live / "cert"), str(live / "key"), str(live / "ca"))
    host = secure.loop.run(serve_health_only(served))
    address = f"127.0.0.1:{host.port}"
    client = lambda c: TlsFiles(str(c.client_cert), str(c.client_key), str(c.ca))
    try:
        assert check_health(address, tls=client(old))
        assert not check_health(address, timeout_s=2.0, tls=client(new))
        for src, name in ((new.service_cert, "cert"), (new.service_key, "key"), (new.ca, "ca")):
            shutil.copy(src, live / name)
        assert check_health(address, tls=client(new))
        assert not check_health(address, timeout_s=2.0, tls=client(old))
        (live / "key").write_text("half written")  # a broken update keeps the last good one
        assert check_health(address, tls=client(new))
    finally:
        secure.loop.run(host.shutdown(0.0))


async def serve_health_only(tls: TlsFiles) -> ServiceHost:
    host = ServiceHost("specmesh.v1.Target", "127.0.0.1:0")  # on the loop it will run in
    await host.start(tls.server_credentials(require_client_auth=True))
    return host


def test_second_server_on_a_live_port_fails(secure, tiny_dir: Path) -> None:
    port = int(secure.target.rsplit(":", 1)[1])
    runtime = TargetRuntime(TargetConfig(str(tiny_dir / "target")))
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        secure.loop.run(serve_target(runtime, port=port))
    assert get_info(secure.target, "target", secure.client_tls).vocab_size  # still serving


def test_bad_tls_files_fail_with_the_flag_and_path(certs: Certs, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=f"--tls-ca-file {missing}: no such file"):
        TlsFiles(ca_file=missing)
    with pytest.raises(ValueError, match="give both or neither"):
        TlsFiles(cert_file=str(certs.service_cert))
    with pytest.raises(ValueError, match=r"--tls-cert-file .* --tls-key-file .*client\.key"):
        TlsFiles(str(certs.service_cert), str(certs.client_key))  # another cert's key
    with pytest.raises(ValueError, match=r"--tls-ca-file .*service\.key: not PEM CA"):
        TlsFiles(ca_file=str(certs.service_key))
    with pytest.raises(ValueError, match="needs --tls-ca-file"):
        TlsFiles(str(certs.service_cert), str(certs.service_key)).server_credentials(True)
    with pytest.raises(ValueError, match="needs --tls-cert-file"):
        TlsFiles(ca_file=str(certs.ca)).server_credentials(False)
