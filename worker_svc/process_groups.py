"""Forming, re-forming and leaving an engine group's process groups (`ProcessGroupsMixin`,
which `DistributedContext` in distributed.py is built on), and the rendezvous every formation
starts with.

Joining: rank 0 hosts a TCPStore at the group's master address, for as long as its process
lives (every formation it leads uses the same server); every rank connects, counts itself in
under the formation's tag (the scheduler's epoch) and, once all are in, creates the groups
from that store. Keys live under the tag, so a straggler of an earlier formation on the same
address cannot be counted in a later one, and a join can be called off (`should_abort`)
until the last rank arrived. `DistributedContext.reform` leaves a (possibly broken) group
and joins a new one in place: the model's layers keep the object.

The groups are torch's backend objects (ProcessGroupGloo / ProcessGroupNCCL) held by the
context, not torch's global default group: a group left with an op still waiting on a frozen
peer cannot be destroyed (gloo's destructor waits for the op), so it is handed to a daemon
thread that lets go of it whenever it can, and the next formation starts at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.op_wait import OpWaiter
from worker_svc.parallel import ParallelConfig

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.05  # how often a joining rank looks at the store
_PROBE_TIMEOUT_S = 0.5


class JoinAborted(RuntimeError):
    """A join was called off (`should_abort`) before every rank of the group arrived."""


class ProcessGroupsMixin:
    """The groups of a `DistributedContext`: joined, re-formed in place and let go of. The
    context's constructor sets the state below."""

    parallel: ParallelConfig
    device: torch.device
    backend: str  # "gloo" | "nccl"
    world: dist.Backend | None  # every rank of the engine group: p2p
    tp_group: dist.Backend | None  # this stage's tensor-parallel ranks
    _store_server: tuple[str, int, dist.TCPStore] | None  # rank 0's, kept across formations
    _waiter: OpWaiter

    def destroy(self) -> None:
        """Leave the process groups, broken or not. They are let go of on a daemon thread:
        an op still waiting on a frozen peer keeps gloo's destructor waiting, maybe for
        ever, and the next formation must not wait with it."""
        groups = [g for g in (self.tp_group, self.world) if g is not None]
        self.tp_group = self.world = None
        if groups:
            threading.Thread(target=groups.clear, name="left-process-groups", daemon=True).start()

    def reform(
        self,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        parallel: ParallelConfig | None = None,
        *,
        tag: str = "",
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        """Leave the current process group, broken or not, and join a new one at
        master_addr:master_port as `parallel`'s rank (default: the same place), mutating
        this object so everything holding it uses the new group. Weights and KV caches
        are untouched; the caller keeps them consistent with the (same) shard.

        Raises like `init_distributed`; after a failure the context holds no group and
        `reform` may be called again.
        """
        if (parallel or self.parallel).world_size == 1:
            raise ValueError("a single-rank group has no process group to re-form")
        self.destroy()
        if parallel is not None:
            self.parallel = parallel
        self._join(master_addr, master_port, timeout_s, tag, should_abort)

    def _join(
        self,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        tag: str,
        should_abort: Callable[[], bool] | None,
    ) -> None:
        parallel = self.parallel
        self._waiter.reset()
        timeout = timedelta(seconds=timeout_s)
        if parallel.rank == 0:

            def open_store() -> dist.Store | None:
                return self._rendezvous_server(master_addr, master_port, timeout)
        else:

            def open_store() -> dist.Store | None:
                return _connect_store(parallel, master_addr, master_port, timeout)

        store = _rendezvous(parallel, tag, timeout_s, should_abort or (lambda: False), open_store)
        self.world = self._new_group(
            dist.PrefixStore("world/", store), parallel.rank, parallel.world_size, timeout
        )
        if parallel.tp_size > 1:
            self.tp_group = self._new_group(
                dist.PrefixStore(f"tp{parallel.pp_rank}/", store),
                parallel.tp_rank,
                parallel.tp_size,
                timeout,
            )
        logger.info(
            "joined engine group%s as rank %d of %d (tp %d/%d, pp %d/%d) over %s",
            f" (epoch {tag})" if tag else "",
            parallel.rank,
            parallel.world_size,
            parallel.tp_rank,
            parallel.tp_size,
            parallel.pp_rank,
            parallel.pp_size,
            self.backend,
        )

    def _rendezvous_server(
        self, address: str, port: int, timeout: timedelta
    ) -> dist.TCPStore | None:
        """Rank 0's store server at address:port, made once and kept; None while the port
        cannot be bound yet (its previous holder, another process, still has it)."""
        if self._store_server is not None and self._store_server[:2] == (address, port):
            return self._store_server[2]
        try:
            store = dist.TCPStore(
                address, port, self.parallel.world_size, True, timeout, wait_for_workers=False
            )
        except dist.DistNetworkError as exc:
            logger.debug("rendezvous port %d not free yet: %s", port, exc)
            return None
        self._store_server = (address, port, store)
        return store

    def _new_group(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.Backend:
        """A process group of `size` ranks meeting at `store`, owned by this object."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, options)
            group.eager_connect_single_device(self.device)  # errors show here, not mid-step
            return group
        return dist.ProcessGroupGloo(store, rank, size, timeout=timeout)


def _rendezvous(
    parallel: ParallelConfig,
    tag: str,
    timeout_s: float,
    should_abort: Callable[[], bool],
    open_store: Callable[[], dist.Store | None],
) -> dist.Store:
    """Every rank of `parallel`'s group at rank 0's store, counted in under `tag`; returns
    the tag's view of the store. `open_store()` is rank 0's server or another rank's client
    of it, None while not possible yet (retried until the deadline)."""
    deadline = time.monotonic() + timeout_s
    prefix = f"pagemesh/{tag}"
    opened = f"{prefix}/open"  # set by rank 0 once it serves this formation
    while True:
        _check_join(should_abort, deadline, timeout_s, "reach the rendezvous store")
        store = open_store()
        if store is not None:
            try:
                if parallel.rank == 0:
                    store.set(opened, "1")
                    break
                if store.check([opened]):
                    break
            except dist.DistNetworkError as exc:
                # An earlier rank 0's store (another process), gone between the connect and
                # this look: the new one comes next.
                logger.debug("rendezvous store went away: %s", exc)
            del store  # not this formation's store yet: wait for it
        time.sleep(_POLL_INTERVAL_S)
    arrived = f"{prefix}/arrived"
    store.add(arrived, 1)
    while store.add(arrived, 0) < parallel.world_size:
        try:
            _check_join(should_abort, deadline, timeout_s, "see every rank arrive")
        except (JoinAborted, TimeoutError):
            if _leave(store, arrived, parallel.world_size):
                raise
            break  # the last rank arrived meanwhile: the others count on this one now
        time.sleep(_POLL_INTERVAL_S)
    return dist.PrefixStore(prefix, store)


def _connect_store(
    parallel: ParallelConfig, master_addr: str, master_port: int, timeout: timedelta
) -> dist.Store | None:
    """A client of rank 0's store; None while nobody listens there yet."""
    # A plain probe first: a TCPStore client logs a stack trace for every failed attempt.
    try:
        socket.create_connection((master_addr, master_port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError:
        return None
    try:
        return dist.TCPStore(
            master_addr, master_port, parallel.world_size, False, timeout, wait_for_workers=False
        )
    except dist.DistNetworkError as exc:
        logger.debug(
            "rendezvous store at %s:%d not reachable yet: %s", master_addr, master_port, exc
        )
        return None


def _leave(store: dist.Store, key: str, world_size: int) -> bool:
    """Uncount this rank, unless everyone already arrived (then the others rely on it)."""
    while True:
        current = store.get(key)
        if int(current) >= world_size:
            return False
        desired = str(int(current) - 1).encode()
        if store.compare_set(key, current, desired) == desired:
            return True


def _check_join(
    should_abort: Callable[[], bool], deadline: float, timeout_s: float, what: str
) -> None:
    if should_abort():
        raise JoinAborted(f"join called off before it could {what}")
    if time.monotonic() > deadline:
        raise TimeoutError(f"could not {what} of the engine group within {timeout_s:g} s")
