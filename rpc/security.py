"""TLS credentials, the router's API key and their command-line flags: the one place that turns
certificate files and keys into gRPC credentials.

Who presents and checks what (docs/security.md):

    client ──TLS (server cert verified with the CA; API key)──► router public port
    router ══mTLS (router cert as client cert; service cert verified with the CA)══► target, draft

- `TlsFiles`: the PEM files of one process. A server serves ``cert_file`` / ``key_file``; a
  target or draft given ``ca_file`` too requires client certificates signed by it. A client
  (the router dialling its services, `GenerationClient`, health probes) verifies servers with
  ``ca_file`` (else the system roots) and presents ``cert_file`` / ``key_file`` when given.
- Server certificates are reloaded without a restart: the files are read again at the first TLS
  handshake after their mtime, size or inode changed (a Kubernetes Secret update swaps them all
  at once). Client certificates (the router's, towards its services) are read once at start.
- `ApiKeyInterceptor`: every RPC except health and reflection needs the metadata
  ``authorization: Bearer <key>`` (what ``grpc.access_token_call_credentials`` sends).
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

API_KEY_ENV = "SPECMESH_API_KEY"
TLS_FLAGS = {
    "cert_file": "--tls-cert-file",
    "key_file": "--tls-key-file",
    "ca_file": "--tls-ca-file",
}
# Probes must work without the key: kubelet / compose health checks, grpcurl discovery.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one process; construction checks them (errors name the flag and path)."""

    cert_file: str | None = None  # certificate chain: served, and presented as client cert
    key_file: str | None = None  # the certificate's private key
    ca_file: str | None = None  # verifies peers: client certs (target, draft), servers (clients)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together: give both or neither")
        for name, flag in TLS_FLAGS.items():
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                why = "not readable" if Path(path).is_file() else "no such file"
                raise ValueError(f"{flag} {path}: {why}")
        self._check_pem()

    def _check_pem(self) -> None:
        """Parse the files as TLS would, so a wrong file fails now, not at the first handshake."""
        try:
            if self.cert_file is not None:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                # an encrypted key fails here instead of prompting: grpc cannot decrypt it
                ctx.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        except ssl.SSLError as e:
            raise ValueError(
                f"--tls-cert-file {self.cert_file} / --tls-key-file {self.key_file}: not a PEM "
                f"certificate and its matching, unencrypted private key ({e.reason or e})"
            ) from None
        try:
            if self.ca_file is not None:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(self.ca_file)
        except ssl.SSLError as e:
            raise ValueError(
                f"--tls-ca-file {self.ca_file}: not PEM CA certificates ({e.reason or e})"
            ) from None

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        """Credentials for a listening port; the certificate is reloaded when its files change.
        With ``require_client_auth`` a client must present a certificate signed by the CA."""
        if self.cert_file is None:
            raise ValueError("serving TLS needs --tls-cert-file and --tls-key-file")
        if require_client_auth and self.ca_file is None:
            raise ValueError("requiring client certificates needs --tls-ca-file")
        reloader = _CertificateReloader(self, require_client_auth)
        return grpc.dynamic_ssl_server_credentials(
            reloader.load(), reloader, require_client_authentication=require_client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for dialling a TLS server: verify it with the CA (else the system roots),
        present this certificate as the client certificate when there is one."""
        read = lambda path: Path(path).read_bytes() if path is not None else None
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def as_args(self) -> list[str]:
        """The command-line flags that give these files to a child process."""
        given = [(flag, getattr(self, name)) for name, flag in TLS_FLAGS.items()]
        return [arg for flag, path in given if path is not None for arg in (flag, path)]

    def signature(self) -> tuple:
        """What changes when any file is rewritten or swapped (stat follows symlinks)."""
        stats = [os.stat(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name)]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)


class _CertificateReloader:
    """grpc's certificate-configuration fetcher: called at every new TLS handshake; returns a
    new configuration when the files changed since the last load, else None (keep serving the
    current one). Files that fail to load (half written, key and certificate mismatched) are
    logged and skipped: the previous certificate stays until the files change again."""

    def __init__(self, files: TlsFiles, require_client_auth: bool) -> None:
        self.files, self.require_client_auth = files, require_client_auth
        self.loaded = files.signature()

    def load(self) -> grpc.ServerCertificateConfiguration:
        f = self.files
        pair = (Path(f.key_file).read_bytes(), Path(f.cert_file).read_bytes())
        ca = Path(f.ca_file).read_bytes() if self.require_client_auth else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            now = self.files.signature()
            if now == self.loaded:
                return None
            self.loaded = now  # before reading: a write racing the read changes it again
            f = self.files
            TlsFiles(f.cert_file, f.key_file, f.ca_file)  # the same checks as at start
            config = self.load()
        except (OSError, ValueError) as e:
            log.warning("TLS files changed but do not load (%s); keeping the previous ones", e)
            return None
        log.info("TLS certificate reloaded from %s", self.files.cert_file)
        return config


# -- clients -----------------------------------------------------------------------------------
def client_channel(
    address: str,
    tls: TlsFiles | None = None,
    api_key: str | None = None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A blocking channel that sends ``api_key`` on every call. Over TLS the key travels as call
    credentials; over plaintext (grpc refuses call credentials there) as plain metadata, so a
    key sent without TLS is readable on the network: use that only on loopback."""
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
        if api_key:
            entry = ("authorization", f"Bearer {api_key}")
            channel = grpc.intercept_channel(channel, _MetadataInterceptor(entry))
        return channel
    credentials = tls.channel_credentials()
    if api_key:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(api_key)
        )
    return grpc.secure_channel(address, credentials, options=options)


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds one metadata entry to every unary-request call (GetInfo, Generate, health)."""

    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry = entry

    def _with_entry(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=[*(details.metadata or ()), self.entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_entry(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_entry(details), request)


# -- the router's API key ----------------------------------------------------------------------
class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC outside `OPEN_SERVICES` with UNAUTHENTICATED unless its metadata holds
    ``authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("--api-key is empty")
        self.key = api_key.encode()

    async def intercept_service(
        self, continuation: Callable, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.split("/")[1] in OPEN_SERVICES:
            return handler
        token = _bearer_token(details.invocation_metadata or ())
        if token is not None and hmac.compare_digest(token.encode(), self.key):
            return handler
        why = "missing API key" if token is None else "invalid API key"
        return _refusal(handler, f"{why}: send metadata 'authorization: Bearer <key>'")


def _bearer_token(metadata: Sequence[tuple[str, str]]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def api_key_interceptors(api_key: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [ApiKeyInterceptor(api_key)] if api_key else []


# -- command line ------------------------------------------------------------------------------
def add_tls_args(p: argparse.ArgumentParser) -> None:
    """``--tls-cert-file --tls-key-file --tls-ca-file``; any of them turns TLS on."""
    g = p.add_argument_group("TLS (any of these turns TLS on)")
    g.add_argument(
        "--tls-cert-file",
        metavar="PEM",
        help="this process's certificate chain: served on its port, and presented as the "
        "client certificate where it dials a service",
    )
    g.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key")
    g.add_argument(
        "--tls-ca-file",
        metavar="PEM",
        help="CA certificates: verify the servers dialled (default: the system roots); "
        "target and draft require client certificates signed by them",
    )


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    files = {name: getattr(args, f"tls_{name}") for name in TLS_FLAGS}
    return TlsFiles(**files) if any(files.values()) else None


def add_api_key_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key", metavar="KEY", help=f"{what} (default: ${API_KEY_ENV})")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The flag wins over the environment; an empty value means no key."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


# A snapshot in the Hugging Face cache: .../models--ORG--NAME/snapshots/<commit>
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/[^/]+/?$")
# A name as services report it (NAME or ORG/NAME, a Hub id's form), not a path
_REPORTED_NAME = re.compile(r"[\w.-]+(?:/[\w.-]+)?")


def model_name(path: str) -> str:
    """What a service reports for a model path, never where the host keeps its files: a Hub
    cache snapshot's Hub id (``ORG/NAME``, not its commit), else the path's last component. A
    name already (``NAME``, ``ORG/NAME``: what a service reported) is kept as it is; the model
    services are given absolute paths (`specmesh.hub.resolve_model`)."""
    hub = _HUB_SNAPSHOT.search(path)
    if hub is not None:
        return hub.group("repo").replace("--", "/")
    parts = path.split("/")
    if _REPORTED_NAME.fullmatch(path) and not {".", ".."} & set(parts):
        return path
    return Path(path).name
