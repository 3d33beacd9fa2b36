"""A synthetic pipeline under interference, with a known truth, for the predictor's unit tests.

The truth model lives in :mod:`lightning_dynpipe.repartition.replay` (the detection benchmark replays it too); this
module keeps the short names the tests use.
"""

from __future__ import annotations

from lightning_dynpipe.repartition.replay import LINK, Env, message_s, true_compute
from lightning_dynpipe.repartition.replay import synthetic_model_cost as model_cost
from lightning_dynpipe.repartition.replay import synthetic_window as window
from lightning_dynpipe.repartition.replay import two_stage_partitions as partitions

__all__ = ["Env", "LINK", "model_cost", "true_compute", "message_s", "window", "partitions"]
