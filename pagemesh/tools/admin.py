"""`pagemesh admin` and `pagemesh profile`: clients of the router's `pagemesh.v1.Admin`.

    pagemesh admin reset-prefix-cache      drop every group's cached prefix blocks
    pagemesh admin memory                  weights, KV cache, swap and RSS of every rank
    pagemesh admin step-stats              steps, busy and communication time, utilisation
    pagemesh profile --seconds 5 --out DIR torch.profiler traces of every worker

The router's address comes from `--address`, else the local `pagemesh up`
(pagemesh/tools/discovery.py), else 127.0.0.1:50051. Exit status: 0, 1 when a group reported an
error, 2 when the call failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich import box
from rich.console import Console
from rich.table import Table

from pagemesh.runtime.config import add_flag, add_tls_flags, tls_config
from pagemesh.tools import discovery
from protos.pagemesh.v1 import admin_pb2, admin_pb2_grpc

MIB = 1 << 20


# --- the calls ---------------------------------------------------------------------------


class AdminClient:
    """The router's Admin service, dialled once; every method raises grpc.RpcError."""

    def __init__(
        self, channel: grpc.Channel, api_key: str | None = None, timeout_s: float = 30.0
    ) -> None:
        self.stub = admin_pb2_grpc.AdminStub(channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.timeout_s = timeout_s

    def reset_prefix_cache(self, group: str = "") -> admin_pb2.ResetPrefixCacheResponse:
        return self.stub.ResetPrefixCache(
            admin_pb2.ResetPrefixCacheRequest(group=group),
            metadata=self.metadata,
            timeout=self.timeout_s,
        )

    def memory(self, group: str = "") -> admin_pb2.GetMemoryResponse:
        return self.stub.GetMemory(
            admin_pb2.GetMemoryRequest(group=group), metadata=self.metadata, timeout=self.timeout_s
        )

    def step_stats(self, group: str = "", window_s: float = 0.0) -> admin_pb2.GetStepStatsResponse:
        return self.stub.GetStepStats(
            admin_pb2.GetStepStatsRequest(group=group, window_s=window_s),
            metadata=self.metadata,
            timeout=self.timeout_s,
        )

    def start_profile(
        self, out_dir: str, group: str = "", record_shapes: bool = False, with_stack: bool = False
    ) -> admin_pb2.StartProfileResponse:
        request = admin_pb2.StartProfileRequest(
            group=group, out_dir=out_dir, record_shapes=record_shapes, with_stack=with_stack
        )
        return self.stub.StartProfile(request, metadata=self.metadata, timeout=self.timeout_s)

    def drain(self, group: str, undo: bool = False) -> admin_pb2.DrainResponse:
        return self.stub.Drain(
            admin_pb2.DrainRequest(group=group, undo=undo),
            metadata=self.metadata,
            timeout=self.timeout_s,
        )

    def stop_profile(self, group: str = "") -> admin_pb2.StopProfileResponse:
        # Writing traces takes a while: the router allows its groups minutes for it.
        return self.stub.StopProfile(
            admin_pb2.StopProfileRequest(group=group),
            metadata=self.metadata,
            timeout=max(self.timeout_s, 360.0),
        )


def profile(
    client: AdminClient,
    seconds: float,
    out_dir: str,
    group: str = "",
    record_shapes: bool = False,
    with_stack: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> admin_pb2.StopProfileResponse:
    """Traces every worker (of `group`) for `seconds`; stops the traces even when
    interrupted. Returns the StopProfile reply (the trace files, per group)."""
    started = client.start_profile(out_dir, group, record_shapes, with_stack)
    errors = [g for g in started.groups if g.error]
    if errors and len(errors) == len(started.groups):
        # Nothing started: stop what may run from an earlier, interrupted trace anyway.
        stopped = client.stop_profile(group)
        for g in stopped.groups:
            g.error = "; ".join(e for e in (_error_of(started, g), g.error) if e)
        return stopped
    try:
        sleep(seconds)
    finally:
        stopped = client.stop_profile(group)
    for g in stopped.groups:
        g.error = "; ".join(e for e in (_error_of(started, g), g.error) if e)
    return stopped


def _error_of(reply: admin_pb2.StartProfileResponse, group: admin_pb2.GroupProfile) -> str:
    return next((g.error for g in reply.groups if g.scheduler_id == group.scheduler_id), "")


# --- the commands ------------------------------------------------------------------------


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--address",
        default=None,
        help="router host:port (default: the local `pagemesh up`'s router, else "
        f"{discovery.DEFAULT_ROUTER_ADDRESS})",
    )
    add_flag(parser, "--api-key", default=None, help="sent as `authorization: Bearer <key>`")
    add_flag(
        parser,
        "--group",
        default="",
        help="one engine group (name or scheduler id); '' = every group",
    )
    add_flag(parser, "--format", default="table", choices=["table", "json"], help="output")
    add_flag(parser, "--timeout-s", type=float, default=30.0, help="seconds to wait per call")
    add_tls_flags(parser)


def add_admin_parser(sub: argparse._SubParsersAction) -> None:
    admin = sub.add_parser(
        "admin", help="admin calls on a running mesh: reset-prefix-cache, memory, step-stats, drain"
    )
    actions = admin.add_subparsers(dest="admin_command", required=True)
    reset = actions.add_parser(
        "reset-prefix-cache", help="drop every cached prefix block no running request holds"
    )
    memory = actions.add_parser("memory", help="weights, KV cache, swap and RSS of every rank")
    stats = actions.add_parser(
        "step-stats", help="steps, busy and communication seconds, utilisation per rank"
    )
    add_flag(
        stats,
        "--window-s",
        type=float,
        default=60.0,
        help="seconds back from now the window figures and utilisation cover (<= 3600)",
    )
    for parser, run in ((reset, _run_reset), (memory, _run_memory), (stats, _run_step_stats)):
        _add_client_flags(parser)
        parser.set_defaults(func=lambda args, run=run: _call(args, run))
    drain = actions.add_parser(
        "drain",
        help="one engine group (--group) admits nothing more and hands its running "
        "requests, with their KV, over to the other groups; it stays up, not "
        "serving, until stopped or --undo",
    )
    add_flag(drain, "--undo", type=bool, default=False, help="take the group back into service")
    _add_client_flags(drain)
    drain.set_defaults(func=_drain)


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="record a torch.profiler trace on every worker")
    add_flag(prof, "--seconds", type=float, default=5.0, help="how long to trace")
    add_flag(
        prof,
        "--out",
        default="pagemesh-traces",
        help="folder for the traces inside each worker's --profile-dir (default "
        "<temp dir>/pagemesh-profiles); the reply lists every file written",
    )
    add_flag(prof, "--record-shapes", type=bool, default=False, help="record op input shapes")
    add_flag(prof, "--with-stack", type=bool, default=False, help="record Python stacks")
    _add_client_flags(prof)
    prof.set_defaults(func=lambda args: _call(args, _run_profile))


def _call(
    args: argparse.Namespace, run: Callable[[AdminClient, argparse.Namespace], Message]
) -> int:
    where = discovery.resolve_router(args.address)
    try:
        tls = tls_config(args)
    except ValueError as exc:
        print(f"pagemesh {args.command}: bad TLS flags: {exc}", file=sys.stderr)
        return 2
    with tls.channel(where.address) as channel:
        client = AdminClient(channel, args.api_key, args.timeout_s)
        try:
            reply = run(client, args)
        except grpc.RpcError as exc:
            print(
                f"pagemesh {args.command}: router at {where.address} ({where.source}): "
                f"{exc.code().name}: {exc.details()}",
                file=sys.stderr,
            )
            return 2
    if args.format == "json":
        print(json.dumps(as_dict(reply), indent=2))
    else:
        _print_table(reply)
    failed = [g for g in reply.groups if g.error]  # type: ignore[attr-defined]
    for group in failed:
        print(f"engine group {group.group or group.scheduler_id}: {group.error}", file=sys.stderr)
    return 1 if failed else 0


def _drain(args: argparse.Namespace) -> int:
    """`pagemesh admin drain --group G`: one line (or JSON) saying what moved."""
    if not args.group:
        print("pagemesh admin drain: name the engine group to drain (--group)", file=sys.stderr)
        return 2
    where = discovery.resolve_router(args.address)
    with tls_config(args).channel(where.address) as channel:
        try:
            reply = AdminClient(channel, args.api_key, args.timeout_s).drain(args.group, args.undo)
        except grpc.RpcError as exc:
            print(
                f"pagemesh admin drain: router at {where.address}: {exc.code().name}: "
                f"{exc.details()}",
                file=sys.stderr,
            )
            return 2
    if args.format == "json":
        print(json.dumps(as_dict(reply), indent=2))
    elif args.undo:
        print(f"engine group {args.group} serves again")
    else:
        print(
            f"engine group {args.group} drained: {reply.num_migrated} requests moved with "
            f"their KV, {reply.num_recomputed} to recompute elsewhere"
        )
    return 0


def _run_reset(client: AdminClient, args: argparse.Namespace) -> Message:
    return client.reset_prefix_cache(args.group)


def _run_memory(client: AdminClient, args: argparse.Namespace) -> Message:
    return client.memory(args.group)


def _run_step_stats(client: AdminClient, args: argparse.Namespace) -> Message:
    return client.step_stats(args.group, args.window_s)


def _run_profile(client: AdminClient, args: argparse.Namespace) -> Message:
    if args.format == "table":
        print(
            f"tracing every worker{f' of {args.group}' if args.group else ''} for "
            f"{args.seconds:g} s into {args.out} (in each worker's --profile-dir) ...",
            file=sys.stderr,
        )
    return profile(client, args.seconds, args.out, args.group, args.record_shapes, args.with_stack)


# --- tables ------------------------------------------------------------------------------


def _print_table(reply: Message) -> None:
    console = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)
    if isinstance(reply, admin_pb2.ResetPrefixCacheResponse):
        table = _table("prefix cache reset", "group", "dropped blocks", "kept (in use)")
        for g in reply.groups:
            table.add_row(g.group, str(g.num_blocks_dropped), str(g.num_blocks_kept_in_use))
    elif isinstance(reply, admin_pb2.GetMemoryResponse):
        table = _table(
            "memory per rank (MiB unless blocks)",
            "group",
            "pp",
            "tp",
            "worker",
            "device",
            "weights",
            "KV",
            "KV blocks used/free/total",
            "KV used",
            "swap",
            "swap blocks used",
            "RSS",
        )
        for g in reply.groups:
            for r in g.ranks:
                table.add_row(
                    g.group,
                    str(r.pp_rank),
                    str(r.tp_rank),
                    r.worker_id,
                    r.device,
                    _mib(r.weight_bytes),
                    _mib(r.kv_cache_bytes),
                    f"{r.num_used_kv_blocks}/{r.num_free_kv_blocks}/{r.num_kv_blocks}",
                    _mib(r.kv_cache_used_bytes),
                    _mib(r.swap_bytes),
                    f"{r.num_used_swap_blocks}/{r.num_swap_blocks}",
                    _mib(r.rss_bytes),
                )
    elif isinstance(reply, admin_pb2.GetStepStatsResponse):
        window = max((r.window_s for g in reply.groups for r in g.ranks), default=0.0)
        table = _table(
            f"step statistics per rank (window {window:.0f} s)",
            "group",
            "pp",
            "tp",
            "worker",
            "steps",
            "busy s",
            "collective s",
            "pp send/recv s",
            "window steps",
            "utilisation",
            "compute",
        )
        for g in reply.groups:
            for r in g.ranks:
                table.add_row(
                    g.group,
                    str(r.pp_rank),
                    str(r.tp_rank),
                    r.worker_id,
                    str(r.num_steps),
                    f"{r.busy_s:.2f}",
                    f"{r.collective_s:.2f}",
                    f"{r.pp_send_s:.2f}/{r.pp_recv_s:.2f}",
                    str(r.window_num_steps),
                    f"{100 * r.utilization:.1f}%",
                    f"{100 * r.compute_fraction:.1f}%",
                )
    else:
        table = _table(
            "profiler traces",
            "group",
            "pp",
            "tp",
            "worker",
            "host",
            "seconds",
            "steps",
            "trace file",
        )
        for g in reply.groups:  # type: ignore[attr-defined]
            for t in g.traces:
                table.add_row(
                    g.group,
                    str(t.pp_rank),
                    str(t.tp_rank),
                    t.worker_id,
                    t.host,
                    f"{t.duration_s:.1f}",
                    str(t.num_steps),
                    t.path,
                )
    console.print(table)


def _table(title: str, *columns: str) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for column in columns:
        table.add_column(
            column,
            justify="left"
            if column in ("group", "worker", "device", "host", "trace file")
            else "right",
        )
    return table


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f}"


def as_dict(reply: Message) -> dict[str, Any]:
    """A reply as JSON-ready data, every field present (what `--format json` prints)."""
    return MessageToDict(
        reply, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
