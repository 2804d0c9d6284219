"""Expert-load balancing under expert parallelism (vLLM's EPLB, by moving experts).

Every `interval` scheduler steps (`--eplb-interval-steps`; the step id decides, so every rank
of a stage rebalances at the same step, a standby that joined late included), each stage's
ranks sum, per sparse layer, the tokens their experts were routed since the last rebalance
(one all-reduce of a [layers, experts] table), and each computes the same new placement
(`balanced_placement`: heaviest first to the least-loaded rank with room, then one-for-one
swaps while they narrow the gap; every rank keeps as many experts as the contiguous
placement gives it, so memory per rank does not change); a layer moves only if that makes
its busiest rank at least `MIN_GAIN` lighter. A rank then holds its new experts: it reads them from
the checkpoint, as
it loaded them, and packs them as the linear layers are packed. Nothing else changes: a
token's expert outputs are still summed on the rank that routed it, experts ascending, so
the tokens are the same before and after.

When the engine group re-forms (a rank died; its standby loaded the contiguous placement),
every survivor returns to the contiguous placement too (`reset`), so the ranks agree again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from worker_svc.model.moe import ExpertPlacement, SparseMoeBlock, checkpoint_name, expert_tensor
from worker_svc.model.parallel_layers import FULL, TPComm

logger = logging.getLogger(__name__)

MIN_GAIN = 0.05  # a layer's experts move only when its busiest rank gets this much lighter

# (layer, expert) -> its (gate_proj, up_proj, down_proj) weights, as the checkpoint has them.
ExpertWeights = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
ExpertReader = Callable[[dict[int, list[int]]], ExpertWeights]


def balanced_placement(loads: Iterable[float], num_ranks: int) -> ExpertPlacement:
    """Each rank holding as many experts as `ExpertPlacement.contiguous` gives it: the
    heaviest experts first (ties: lower id), each to the least-loaded rank with room (ties:
    lower rank), then swaps of one expert for one between the most and the least loaded
    rank while a swap narrows their gap. Deterministic: every rank computes the same."""
    loads = list(loads)
    room = [
        len(ExpertPlacement.contiguous(len(loads), num_ranks).experts_of(rank))
        for rank in range(num_ranks)
    ]
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    total = [0.0] * num_ranks
    for expert in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        rank = min(
            (r for r in range(num_ranks) if len(held[r]) < room[r]), key=lambda r: (total[r], r)
        )
        held[rank].append(expert)
        total[rank] += loads[expert]
    for _ in range(len(loads) * num_ranks):  # each swap narrows the widest gap: bounded
        if not _swap_once(loads, held, total):
            break
    owner = [0] * len(loads)
    for rank, experts in enumerate(held):
        for expert in experts:
            owner[expert] = rank
    return ExpertPlacement(tuple(owner))


def _swap_once(loads: list[float], held: list[list[int]], total: list[float]) -> bool:
    """The one swap between the most and the least loaded rank that narrows their gap most."""
    high = max(range(len(total)), key=lambda r: (total[r], -r))
    low = min(range(len(total)), key=lambda r: (total[r], r))
    gap = total[high] - total[low]
    best: tuple[float, int, int] | None = None
    for i in held[high]:
        for j in held[low]:
            moved = loads[i] - loads[j]
            if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                best = (abs(gap - 2 * moved), i, j)
    if best is None or best[0] >= gap:
        return False
    _, i, j = best
    held[high][held[high].index(i)], held[low][held[low].index(j)] = j, i
    moved = loads[i] - loads[j]
    total[high] -= moved
    total[low] += moved
    return True


def busiest(placement: ExpertPlacement, loads: list[float]) -> float:
    """The load of the most loaded rank under `placement`."""
    totals: dict[int, float] = {}
    for expert, rank in enumerate(placement.owner):
        totals[rank] = totals.get(rank, 0.0) + loads[expert]
    return max(totals.values())


def expert_parallel_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.placement is not None]


class ExpertBalancer:
    """Rebalances a stage's expert-parallel layers every `interval` steps (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, comm: TPComm, reader: ExpertReader, interval: int
    ) -> None:
        self.blocks = expert_parallel_blocks(model)
        self.comm = comm
        self.reader = reader
        self.interval = interval
        self.num_rebalances = 0

    def maybe_rebalance(self, step_id: int) -> bool:
        """At every `interval`-th step id (collective: every rank of the stage calls it with
        the same step)."""
        if not self.blocks or self.interval <= 0 or step_id <= 0 or step_id % self.interval:
            return False
        self.rebalance()
        return True

    def rebalance(self) -> None:
        windows = torch.stack([block.take_window_tokens() for block in self.blocks])
        loads = self.comm.tp_all_reduce(windows.to(torch.float64)).cpu()
        wanted = {}
        for i, block in enumerate(self.blocks):
            layer_loads = loads[i].tolist()
            better = balanced_placement(layer_loads, block.tp_size)
            # Moving costs a read of the experts: only for a clearly lighter busiest rank.
            gain = busiest(block.placement, layer_loads) - busiest(better, layer_loads)
            keep = gain <= MIN_GAIN * busiest(block.placement, layer_loads)
            wanted[block.layer_index] = block.placement if keep else better
        self._apply(wanted)
        self.num_rebalances += 1

    def reset(self) -> None:
        """Back to the contiguous placement (after the group re-formed)."""
        for block in self.blocks:
            block.take_window_tokens()
        self._apply(
            {
                block.layer_index: ExpertPlacement.contiguous(
                    len(block.placement.owner), block.tp_size
                )
                for block in self.blocks
            }
        )

    def _apply(self, wanted: dict[int, ExpertPlacement]) -> None:
        changed = [block for block in self.blocks if wanted[block.layer_index] != block.placement]
        if not changed:
            return
        needed = {
            block.layer_index: wanted[block.layer_index].experts_of(block.tp_rank)
            for block in changed
        }
        weights = self.reader(needed)
        for block in changed:
            layer = block.layer_index
            block.set_placement(wanted[layer], lambda e, layer=layer: weights[layer, e])
        logger.info(
            "experts rebalanced in %d layers; this rank now holds %s",
            len(changed),
            {layer: experts for layer, experts in needed.items()},
        )


def checkpoint_reader(open_weights: Callable[[Callable[[str], object]], Iterable]) -> ExpertReader:
    """An `ExpertReader` over a checkpoint's weight stream (`loader.ModelSource.weights`):
    reads whole expert tensors of the asked layers and experts only."""

    def read(needed: dict[int, list[int]]) -> ExpertWeights:
        wanted = {(layer, e) for layer, experts in needed.items() for e in experts}

        def select(name: str):
            found = expert_tensor(checkpoint_name(name))
            if found is None:
                return None
            path, expert, _ = found
            layer = int(path.split(".")[2])
            return FULL if (layer, expert) in wanted else None

        parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for name, tensor in open_weights(select):
            path, expert, part = expert_tensor(checkpoint_name(name))
            parts.setdefault((int(path.split(".")[2]), expert), {})[part] = tensor
        missing = wanted - set(parts)
        if missing:
            raise ValueError(f"the checkpoint lacks experts {sorted(missing)[:5]}")
        return {key: (p["gate_proj"], p["up_proj"], p["down_proj"]) for key, p in parts.items()}

    return read
