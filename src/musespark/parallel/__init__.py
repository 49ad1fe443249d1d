"""Parallel deployments (tensor, expert and pipeline parallelism): where a rank sits and
the collectives the sharded decoder uses (`state.py`), and what each rank holds (`plan.py`)."""

from .plan import RankPlan, expert_range, plan_memory, pp_indices, pp_layer_split
from .state import SINGLE, ParallelContext, init_parallel

__all__ = [
    "SINGLE",
    "ParallelContext",
    "RankPlan",
    "expert_range",
    "init_parallel",
    "plan_memory",
    "pp_indices",
    "pp_layer_split",
]
