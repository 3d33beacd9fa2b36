"""The pipeline engine: P2P channels, weight stashing, stage executor (torch + torch.distributed, no Lightning)."""

from lightning_dynpipe.engine.executor import StageChannels, StageExecutor, StepStats
from lightning_dynpipe.engine.microbatch import split_microbatches
from lightning_dynpipe.engine.stash import WeightStash
from lightning_dynpipe.engine.topology import PipelineTopology

__all__ = ["StageExecutor", "StageChannels", "StepStats", "WeightStash", "PipelineTopology", "split_microbatches"]
