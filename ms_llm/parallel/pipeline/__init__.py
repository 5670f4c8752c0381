"""Pipeline parallelism: schedules as per-rank action lists (``schedules``) and their executor."""
