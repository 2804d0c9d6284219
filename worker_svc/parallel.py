"""Where one worker sits in its engine group: tensor-parallel rank and pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """An engine group is `tp_size x pp_size` workers; global rank = pp_rank * tp_size + tp_rank.

    `pp_layer_split` gives the number of decoder layers of each stage (sums to the model's
    layer count); None splits as evenly as possible, earlier stages taking the remainder.
    `expert_parallel` (`--enable-expert-parallel`): a mixture-of-experts layer's experts are
    placed whole on the stage's TP ranks instead of each rank holding a slice of every one
    (`worker_svc/model/moe.py`); attention stays tensor-parallel.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pp_layer_split: tuple[int, ...] | None = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(
                f"tp_size and pp_size must be >= 1, got {self.tp_size}, {self.pp_size}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} not in 0..{self.tp_size - 1}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} not in 0..{self.pp_size - 1}")
        if self.pp_layer_split is not None:
            if len(self.pp_layer_split) != self.pp_size or min(self.pp_layer_split) < 1:
                raise ValueError(
                    f"pp_layer_split {self.pp_layer_split} needs {self.pp_size} "
                    "positive layer counts, one per stage"
                )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples and returns tokens: tp rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this stage holds."""
        split = self.pp_layer_split or _even_split(num_layers, self.pp_size)
        if sum(split) != num_layers:
            raise ValueError(
                f"pp_layer_split {split} sums to {sum(split)}, the model has {num_layers} layers"
            )
        start = sum(split[: self.pp_rank])
        return range(start, start + split[self.pp_rank])


def _even_split(num_layers: int, pp_size: int) -> tuple[int, ...]:
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if stage < extra else 0) for stage in range(pp_size))


def global_rank(parallel: ParallelConfig, pp_rank: int, tp_rank: int) -> int:
    """The global rank of (pp_rank, tp_rank) in `parallel`'s engine group."""
    return pp_rank * parallel.tp_size + tp_rank


def tp_group_ranks(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Global ranks of one pipeline stage: the tensor-parallel group of that stage."""
    return [global_rank(parallel, pp_rank, tp_rank) for tp_rank in range(parallel.tp_size)]
