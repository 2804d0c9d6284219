"""Flag parsing shared by the services: every flag also reads a `PAGEMESH_*` variable, or,
when that is unset, the file a `PAGEMESH_*_FILE` variable names (the container convention
for secrets: PAGEMESH_INTERNAL_TOKEN_FILE=/run/secrets/internal_token).

Variables are read when `main` parses its arguments, never at import time.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from pagemesh.runtime.metrics import MetricsConfig
from pagemesh.runtime.registry import RegistryConfig
from pagemesh.runtime.service_flags_base import ServiceFlag
from pagemesh.runtime.serving import ServerConfig
from pagemesh.runtime.tls import TlsConfig


def env_name(flag: str) -> str:
    return "PAGEMESH_" + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def env_value(env: str) -> str | None:
    """The variable `env` when set and not empty, else the contents of the file that
    `<env>_FILE` names (its trailing newline dropped), else None."""
    value = os.environ.get(env)
    if value:
        return value
    path = os.environ.get(env + "_FILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().rstrip("\r\n") or None
    except OSError as exc:
        raise SystemExit(f"{env}_FILE={path}: cannot read it ({exc.strerror})") from exc


class _AppendReplacingDefault(argparse._AppendAction):
    """`action="append"` whose first use on the command line drops the default list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    **kwargs: Any,
) -> None:
    """Adds `--flag` whose default comes from `PAGEMESH_FLAG` when that is set and not empty
    (compose's `${VAR:-}` leaves a flag at its default); a repeatable flag's items are
    separated by spaces there."""
    env = env_name(flag)
    value = env_value(env)
    if type is bool:
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=_parse_bool(value) if value is not None else default,
            help=f"{help} [env {env}]",
            **kwargs,
        )
        return
    if kwargs.get("action") == "append":
        # Flags given on the command line replace the variable's item, not add to it.
        kwargs["action"] = _AppendReplacingDefault
        if value is not None:  # items separated by spaces
            default = [type(item) for item in value.split()]
    elif value is not None:
        default = type(value)
    parser.add_argument(
        flag,
        type=type,
        default=default,
        help=f"{help} (default: {default}) [env {env}]",
        **kwargs,
    )


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[ServiceFlag]
) -> None:
    """Adds each of `flags` (pagemesh.runtime.service_flags) as `add_flag` would: a service's own
    table, or every option on `pagemesh up`."""
    for flag in flags:
        kwargs: dict[str, Any] = {}
        if flag.choices is not None:
            kwargs["choices"] = list(flag.choices)
        if flag.repeatable:
            kwargs["action"] = "append"
        add_flag(parser, flag.name, type=flag.type, default=flag.default, help=flag.help, **kwargs)


def add_registry_flags(parser: argparse.ArgumentParser) -> None:
    """Where the registry is. The heartbeat flags `registry_config` reads come with every
    service's options (pagemesh.runtime.service_flags)."""
    add_flag(
        parser,
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis holding the registry and heartbeats: redis://[user[:password]@]host:"
        "port/db, or rediss:// for TLS",
    )
    add_redis_password_flag(parser)
    add_flag(parser, "--cluster", default="pagemesh", help="key prefix of this mesh in Redis")


def add_redis_password_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add_flag(
        parser,
        "--redis-password",
        default=None,
        help="password of --redis-url's user, when the URL does not carry it; give it as "
        "PAGEMESH_REDIS_PASSWORD or in a file named by PAGEMESH_REDIS_PASSWORD_FILE "
        "(a compose or Kubernetes secret), never on a command line",
    )


def with_password(url: str, password: str | None) -> str:
    """`url` with `password` for its user (the default user when it names none); `url` as it
    is without one."""
    if not password:
        return url
    parts = urllib.parse.urlsplit(url)
    user = urllib.parse.quote(urllib.parse.unquote(parts.username or ""), safe="")
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    netloc = f"{user}:{urllib.parse.quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def registry_config(args: argparse.Namespace) -> RegistryConfig:
    return RegistryConfig(
        redis_url=with_password(args.redis_url, args.redis_password),
        cluster=args.cluster,
        heartbeat_interval_s=args.heartbeat_interval_s,
        ttl_s=args.heartbeat_ttl_s,
    )


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Where this process serves. `--shutdown-grace-s`, `--log-level` and
    `--otlp-traces-endpoint` come with every service's options (pagemesh.runtime.service_flags)."""
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind")
    add_flag(
        parser, "--port", type=int, default=default_port, help="port to bind; 0 = any free port"
    )
    add_flag(
        parser,
        "--advertise-host",
        default=None,
        help="address other services dial (default: --host)",
    )
    add_flag(
        parser,
        "--metrics-port",
        type=int,
        default=0,
        help="port of the Prometheus /metrics endpoint on --host (plain HTTP); "
        "0 = any free port (published in the registry), -1 = off",
    )
    add_tls_flags(parser)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--tls-cert",
        default=None,
        help="PEM certificate this service presents; with --tls-key it serves TLS",
    )
    add_flag(parser, "--tls-key", default=None, help="PEM private key of --tls-cert")
    add_flag(
        parser,
        "--tls-ca",
        default=None,
        help="PEM CA: clients dial other services over TLS, verified against it, and "
        "(unless --tls-client-ca says otherwise) servers require client "
        "certificates signed by it (mTLS)",
    )
    add_flag(
        parser,
        "--tls-client-ca",
        default=None,
        help="PEM CA that clients' certificates must chain to, when it is not --tls-ca; "
        "`none`: serve TLS without asking for client certificates (a public router "
        "that dials its schedulers with mTLS)",
    )


def tls_config(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(
        cert_path=args.tls_cert,
        key_path=args.tls_key,
        ca_path=args.tls_ca,
        client_ca_path=getattr(args, "tls_client_ca", None),
        internal_token=getattr(args, "internal_token", None) or None,
    )


def metrics_config(args: argparse.Namespace) -> MetricsConfig:
    return MetricsConfig(host=args.host, port=args.metrics_port, advertise_host=args.advertise_host)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        grace_s=args.shutdown_grace_s,
        tls=tls_config(args),
    )
