"""`pagemesh health`: one standard gRPC health check (`grpc.health.v1.Health/Check`).

Made for container health checks and scripts: the exit status is 0 when the service answers
SERVING and 1 for anything else (NOT_SERVING, UNKNOWN, an unknown service name, nothing
listening, a timeout, a TLS mismatch) — Docker's HEALTHCHECK contract, where 2 is reserved.
It prints one line on stderr saying what it saw. Every pagemesh service answers it: a router
is SERVING while some engine group is ready, a scheduler while its group is complete, and any
service turns NOT_SERVING as it starts to drain on SIGTERM. With no `--address` it checks
the router of the local `pagemesh up` (pagemesh/tools/discovery.py), else 127.0.0.1:50051.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.config import add_flag, add_tls_flags, tls_config
from pagemesh.runtime.tls import TlsConfig
from pagemesh.tools import discovery


def add_health_parser(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser(
        "health", help="check a service's gRPC health: exit 0 if SERVING, else 1"
    )
    add_flag(
        health,
        "--address",
        default=None,
        help="host:port of a router, scheduler or worker (default: the local "
        f"`pagemesh up`'s router, else {discovery.DEFAULT_ROUTER_ADDRESS})",
    )
    add_flag(
        health,
        "--service",
        default="",
        help="service name to ask about, e.g. pagemesh.v1.Generation ('' = the whole server)",
    )
    add_flag(
        health,
        "--timeout-s",
        type=float,
        default=2.0,
        help="seconds to wait for the connection and the answer together",
    )
    add_tls_flags(health)  # the service's own PAGEMESH_TLS_* variables make a valid client
    add_flag(
        health,
        "--tls-server-name",
        default=None,
        help="name to verify the server certificate against instead of the host in "
        "--address (e.g. the service name in its certificate when dialing 127.0.0.1)",
    )
    health.set_defaults(func=run_health)


def check(
    address: str, service: str, timeout_s: float, tls: TlsConfig, tls_server_name: str | None = None
) -> tuple[bool, str]:
    """One Check call: (whether the service is SERVING, what was seen, as one line)."""
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else None
    label = f"{address} ({service or 'server'}, {'TLS' if tls.dials_tls else 'plaintext'})"
    with tls.channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{label}: {_describe_error(exc, timeout_s, tls.dials_tls)}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, f"{label}: {status}"


def _describe_error(exc: grpc.RpcError, timeout_s: float, dials_tls: bool) -> str:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {timeout_s:g} s"
    if code == grpc.StatusCode.UNAVAILABLE:
        details = exc.details() or ""
        # A plaintext dial of a TLS port is cut off rather than refused.
        hint = "" if dials_tls or "refused" in details.lower() else "; a TLS server needs --tls-ca"
        return f"unreachable: {details}{hint}"
    if code == grpc.StatusCode.NOT_FOUND:
        return "unknown service name (the server does not report on it)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "not a gRPC health server"
    return f"{code.name}: {exc.details()}"


def run_health(args: argparse.Namespace) -> int:
    try:
        tls = tls_config(args)
    except ValueError as exc:  # a missing certificate file, a key without its certificate
        serving, seen = False, f"bad TLS flags: {exc}"
    else:
        where = discovery.resolve_router(args.address)
        serving, seen = check(
            where.address, args.service, args.timeout_s, tls, args.tls_server_name
        )
        if not serving and where.source != "--address":
            seen += f" [address from {where.source}]"
    print(f"pagemesh health: {seen}", file=sys.stderr)
    return 0 if serving else 1
