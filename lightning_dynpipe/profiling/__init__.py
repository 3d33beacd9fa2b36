"""Per-layer profiling (torch only): forward/backward time, activation, parameter and optimizer bytes, memory.

Example::

    from lightning_dynpipe.demos import MLP
    from lightning_dynpipe.profiling import profile_layers

    model = MLP(width=1024, depth=8)
    profile = profile_layers(model.pipeline, model.example_input(64))
    print(profile.table())
    model_cost = profile.to_model_cost()   # the planner's input (plan.costs.ModelCost)
"""

from lightning_dynpipe.profiling.layers import LayerProfile, LayerStats, optimizer_state_factor, profile_layers

__all__ = ["LayerProfile", "LayerStats", "optimizer_state_factor", "profile_layers"]
