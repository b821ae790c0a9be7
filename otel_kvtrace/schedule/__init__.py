"""Recv-thread scheduling: the policy rules shared with the what-if, and the live scheduler."""

from otel_kvtrace.schedule.install import (
    LIVE,
    MERGED_LIVE,
    SCHEDULERS,
    active_scheduler,
    add_listener,
    attach,
    check_scheduler,
    from_env,
    install_from_env,
    install_scheduler,
    scheduler_in_force,
    threads_seen,
)
from otel_kvtrace.schedule.queue import SchedulingQueue

__all__ = ["LIVE", "MERGED_LIVE", "SCHEDULERS", "SchedulingQueue", "active_scheduler", "add_listener", "attach", "check_scheduler", "from_env",
           "install_from_env", "install_scheduler", "scheduler_in_force",
           "threads_seen"]
