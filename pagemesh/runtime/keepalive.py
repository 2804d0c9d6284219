"""How long a silent peer is given: HTTP/2 keepalive on every channel and server of the mesh.

A peer that dies closes its sockets and the other side learns at once. A peer that is frozen
(SIGSTOP, a wedged host, a full GC pause of the machine) or cut off by the network closes
nothing: without keepalive, a call to it waits for its deadline (a step: --step-timeout-s)
and a stream to it (the router's to a scheduler, a scheduler's to a router) waits for ever.
With it, each side pings the other every `PING_INTERVAL_S` while the connection is open and
declares the connection broken when a ping goes unanswered for `PING_TIMEOUT_S`; every call
on it fails UNAVAILABLE, which the mesh already handles as a dead peer (a step fails and the
group re-forms, a router resumes the stream on another group, a scheduler orphans the
requests of a router gone). So a silent peer is noticed within PING_INTERVAL_S +
PING_TIMEOUT_S (5 s).

Pings are answered by gRPC's own threads, not by Python: a busy service (a long forward
pass, a blocked event loop) still answers them; only a process that does not run at all, or
cannot be reached, misses them.
"""

from __future__ import annotations

PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 3.0

_SHARED = [
    ("grpc.keepalive_time_ms", int(PING_INTERVAL_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    # gRPC's own bound on an unanswered ping is 60 s unless this is set too.
    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),  # an idle connection is watched too
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *_SHARED,
    ("grpc.http2.max_pings_without_data", 0),  # ping however long no data flows
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    *_SHARED,
    # Accept the clients' pings at their rate instead of answering GOAWAY "too_many_pings"
    # (the default wants 5 minutes between pings on an idle connection).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(PING_INTERVAL_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
