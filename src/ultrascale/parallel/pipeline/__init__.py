"""Pipeline parallelism: schedules as data (`schedules`), their simulator (`simulator`).

The torch-side pieces (stage split, executor) live in their own modules so that the planner and
the memory estimator can import the schedules and the simulator without touching torch.
"""

from ultrascale.parallel.pipeline.schedules import (
    SCHEDULE_NAMES, Action, PipelineDeadlock, add_communication, build_schedule, check_program,
    validate_schedule,
)
from ultrascale.parallel.pipeline.simulator import SimResult, simulate, simulate_program

__all__ = [
    "SCHEDULE_NAMES", "Action", "PipelineDeadlock", "SimResult", "add_communication",
    "build_schedule", "check_program", "simulate", "simulate_program", "validate_schedule",
]
