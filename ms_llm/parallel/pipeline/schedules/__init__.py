"""Pipeline-parallel schedules as data: per rank, a list of forward/backward(/weight-gradient)
actions, one record (``ScheduleSpec``) per schedule, one file each.

``spec`` holds the record and the registry (``get_schedule``, ``schedule_of``, ``all_schedules``);
``placement`` the maps between virtual stages and (rank, chunk); ``rounds`` the lockstep replay
every schedule runs through (the executor's script and the simulator); ``actions`` the unit the
schedules are made of. Every other module here is one schedule and defines ``SCHEDULE``.
"""
from .actions import Action, kept_backwards
from .placement import ROUND_ROBIN, V_SHAPE, StagePlacement
from .rounds import (Round, bubble_fraction, describe_rounds, format_schedule, plan_rounds,
                     transfers_after, validate_schedule)
from .spec import ScheduleSpec, all_schedules, get_schedule, schedule_of

__all__ = ["Action", "kept_backwards", "ROUND_ROBIN", "V_SHAPE", "StagePlacement", "Round",
           "bubble_fraction", "describe_rounds", "format_schedule", "plan_rounds",
           "transfers_after", "validate_schedule", "ScheduleSpec", "all_schedules",
           "get_schedule", "schedule_of"]
