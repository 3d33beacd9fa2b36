"""Where each stage of each pipeline replica runs: a pure mapping between global ranks and coordinates."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["PipelineTopology"]


@dataclass(frozen=True)
class PipelineTopology:
    """Maps global ranks to ``(dp_rank, stage_idx)`` and back.

    A pipeline is ``num_stages`` consecutive global ranks; ``world_size / num_stages`` pipelines (data-parallel
    replicas) run side by side. Inside a pipeline, the **last** stage sits on the pipeline's first rank, so the
    last stage of pipeline 0, where the user's ``training_step`` runs and logs, is global rank 0 with
    Lightning's loggers, progress bar and checkpoint writing::

        num_stages=3, world_size=6:   rank 0 1 2 | 3 4 5
                                      stage 2 0 1 | 2 0 1

    Example::

        >>> topo = PipelineTopology(num_stages=2, world_size=2)
        >>> topo.rank_of(dp_rank=0, stage_idx=0), topo.rank_of(0, 1)
        (1, 0)
    """

    num_stages: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigurationError(f"num_stages must be at least 1; got {self.num_stages}.")
        if self.world_size % self.num_stages != 0:
            raise ConfigurationError(
                f"The number of processes ({self.world_size} = devices x num_nodes) must be divisible by "
                f"num_stages={self.num_stages}: every pipeline replica needs all its stages. Use devices that are "
                f"a multiple of {self.num_stages}, or set num_stages to a divisor of {self.world_size}."
            )

    @property
    def dp_size(self) -> int:
        """Number of pipeline replicas."""
        return self.world_size // self.num_stages

    def rank_of(self, dp_rank: int, stage_idx: int) -> int:
        """Global rank of ``stage_idx`` in pipeline ``dp_rank``."""
        return dp_rank * self.num_stages + (stage_idx + 1) % self.num_stages

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, stage_idx)`` of a global rank."""
        dp_rank, local = divmod(rank, self.num_stages)
        return dp_rank, (local - 1) % self.num_stages

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of pipeline ``dp_rank``, stage 0 first."""
        return [self.rank_of(dp_rank, k) for k in range(self.num_stages)]

    def stage_ranks(self, stage_idx: int) -> list[int]:
        """Global ranks holding ``stage_idx`` in every pipeline (the stage's data-parallel group)."""
        return [self.rank_of(d, stage_idx) for d in range(self.dp_size)]
