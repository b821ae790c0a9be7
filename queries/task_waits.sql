-- name: task_waits
-- implements: docs/serving.md (experiment per-run metrics: mean queue and consumer wait, wait percentiles)
-- requires: tasks
-- purpose: over every recv task loaded: the mean queue wait and consumer wait per task and the
--   p50/p95/p99 of the queue wait and of the dependency wait (one row), for the experiment report.
-- definition:
--   One rule: a task's missing stage counts 0, in the means and the percentiles alike. The dependency wait of a task is save_cpu_wait +
--   save_npu_sync + gate_cond_wait + gate_npu_sync + slot_release_wait (missing stages 0), as in
--   hol_summary. Percentiles are continuous (quantile_cont) over every recv task.
-- columns:
--   queue_wait_ms     DOUBLE     mean queue wait per task, ms
--   consumer_wait_ms  DOUBLE     mean consumer wait per task, ms
--   tasks             BIGINT     recv tasks
--   queue_wait_ns     DOUBLE[]   p50, p95, p99 of the queue wait, ns
--   dep_wait_ns       DOUBLE[]   p50, p95, p99 of the dependency wait, ns
SELECT avg(coalesce(queue_wait_ns, 0)) / 1e6 AS queue_wait_ms,
       avg(coalesce(consumer_wait_ns, 0)) / 1e6 AS consumer_wait_ms,
       count(*) AS tasks,
       quantile_cont(coalesce(queue_wait_ns, 0), [0.5, 0.95, 0.99]) AS queue_wait_ns,
       quantile_cont(coalesce(save_cpu_wait_ns, 0) + coalesce(save_npu_sync_ns, 0) + coalesce(gate_cond_wait_ns, 0)
                     + coalesce(gate_npu_sync_ns, 0) + coalesce(slot_release_wait_ns, 0), [0.5, 0.95, 0.99])
           AS dep_wait_ns
FROM tasks
