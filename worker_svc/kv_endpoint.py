"""This rank's side of KV moving between engine groups (worker_svc/kv_transfer/): a
transfer server other groups' ranks read its blocks from, and pulls of theirs into its own
cache (`PullKv`, which the scheduler sends when a request arrives with its KV held on
another group).

A pull runs on its own thread, beside the steps: it writes only blocks the scheduler gave
the importing request, which no step touches until the pull has answered. Its answer is
the transfer's terminal result, by its deadline.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from worker_svc.kv_transfer.layout import RankSlice, host_key, slice_for_rank
from worker_svc.kv_transfer.pull import PullResult, pull_blocks
from worker_svc.kv_transfer.server import KVTransferServer
from worker_svc.runner import ModelRunner

logger = logging.getLogger(__name__)


class KVEndpoint:
    def __init__(
        self,
        runner: ModelRunner,
        host: str,
        advertise_host: str | None,
        port: int = 0,
        token: str | None = None,
    ) -> None:
        config = runner.model.config
        self.caches = runner.kv_caches
        mine = slice_for_rank(
            runner.parallel,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            block_size=runner.kv_spec.block_size,
            head_dim=runner.kv_spec.head_dim,
            dtype=str(runner.kv_spec.dtype).split(".")[-1],
            key=host_key(),
        )
        self.server = KVTransferServer(self.caches, mine, token, host=host, port=port)
        self.server.start()
        bound = self.server.address.rsplit(":", 1)[1]
        self.rank_slice = RankSlice(
            mine.layer_start,
            mine.num_layers,
            mine.kv_head_start,
            mine.num_kv_heads,
            mine.block_size,
            mine.head_dim,
            mine.dtype,
            f"{advertise_host or host}:{bound}",
            mine.host_key,
        )
        self.token = token
        self._pulls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        self.num_pulls = 0
        self.num_pull_failures = 0
        self.bytes_pulled = 0
        logger.info(
            "KV transfer server on %s (%s)", self.rank_slice.address, self.rank_slice.describe()
        )

    def pull(
        self,
        sources: list[RankSlice],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        timeout_s: float,
        token: str,
        transfer_id: str,
    ) -> PullResult:
        """Blocking: this rank's share of the source blocks into `dst_block_ids`."""
        result = pull_blocks(
            self.rank_slice,
            self.caches,
            sources,
            src_block_ids,
            dst_block_ids,
            time.monotonic() + timeout_s,
            token or None,
            transfer_id,
        )
        if result.ok and self.caches[0].device.type == "cuda":
            torch.cuda.current_stream(self.caches[0].device).synchronize()
        self.num_pulls += 1
        if result.ok:
            self.bytes_pulled += result.nbytes
        else:
            self.num_pull_failures += 1
            logger.warning("KV pull %s failed: %s", transfer_id, result.reason)
        return result

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._pulls

    def close(self) -> None:
        self.server.close()
        self._pulls.shutdown(wait=False, cancel_futures=True)
