-- name: stage_breakdown
-- implements: docs/schema.md, child spans (one child span per stage)
-- requires: tasks
-- purpose: where a recv task's time goes: count and latency percentiles of every stage, per
--   configuration and path, plus the whole task (enqueue -> completion) as stage `task_total`.
-- definition:
--   One value per task and stage: the stage's duration (tasks.<stage>_ns, NULL when the stage did not
--   happen, and then not counted). `task_total` is ts_complete - ts_enqueue.
-- columns:
--   cfg_label   VARCHAR  configuration label
--   path        VARCHAR  gva or key
--   stage       VARCHAR  child span name, or task_total
--   stage_order INTEGER  pipeline position (queue_wait = 1 ... consumer_wait = 11, task_total = 12)
--   count       BIGINT   tasks in which the stage happened
--   mean_ms     DOUBLE   mean duration, ms
--   p50_ms      DOUBLE   median duration, ms
--   p95_ms      DOUBLE   95th percentile, ms
--   p99_ms      DOUBLE   99th percentile, ms
--   max_ms      DOUBLE   longest, ms
--   total_ms    DOUBLE   sum over tasks, ms
WITH durations AS (
    SELECT cfg_label, path, stage, dur_ns FROM (
        SELECT cfg_label, path, queue_wait_ns, save_cpu_wait_ns, save_npu_sync_ns, gate_cond_wait_ns,
               gate_npu_sync_ns, meta_build_ns, h2d_stagger_ns, slot_release_wait_ns, backend_submit_ns,
               completion_ns, consumer_wait_ns, ts_complete - ts_enqueue AS task_total_ns
        FROM tasks
    ) UNPIVOT (dur_ns FOR stage IN (
        queue_wait_ns AS 'queue_wait', save_cpu_wait_ns AS 'save_cpu_wait', save_npu_sync_ns AS 'save_npu_sync',
        gate_cond_wait_ns AS 'gate_cond_wait', gate_npu_sync_ns AS 'gate_npu_sync', meta_build_ns AS 'meta_build',
        h2d_stagger_ns AS 'h2d_stagger', slot_release_wait_ns AS 'slot_release_wait',
        backend_submit_ns AS 'backend_submit', completion_ns AS 'completion', consumer_wait_ns AS 'consumer_wait',
        task_total_ns AS 'task_total'))
)
SELECT cfg_label, path, stage,
       list_position(['queue_wait', 'save_cpu_wait', 'save_npu_sync', 'gate_cond_wait', 'gate_npu_sync',
                      'meta_build', 'h2d_stagger', 'slot_release_wait', 'backend_submit', 'completion',
                      'consumer_wait', 'task_total'], stage)::INTEGER AS stage_order,
       count(*) AS count,
       avg(dur_ns) / 1e6 AS mean_ms,
       quantile_cont(dur_ns, 0.5) / 1e6 AS p50_ms,
       quantile_cont(dur_ns, 0.95) / 1e6 AS p95_ms,
       quantile_cont(dur_ns, 0.99) / 1e6 AS p99_ms,
       max(dur_ns) / 1e6 AS max_ms,
       sum(dur_ns) / 1e6 AS total_ms
FROM durations
GROUP BY cfg_label, path, stage
ORDER BY cfg_label, path, stage_order
