"""Pipeline parallelism: trunk discovery, stage placement, schedules as data, and the runtime."""

from lightning_parallel.pipeline.schedules import (
    Action,
    Schedule,
    build_schedule,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
)

__all__ = [
    "Action",
    "Schedule",
    "build_schedule",
    "format_schedule",
    "gpipe",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "simulate",
]
