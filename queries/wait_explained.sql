-- name: wait_explained
-- implements: docs/schema.md, child spans (child spans cover the task)
-- requires: tasks
-- purpose: check that the recv-thread stage spans explain each task's time; every task whose total
--   differs from the sum of its stages by more than 1% is listed (never hidden), worst first.
-- definition:
--   total = ts_complete - ts_enqueue. explained = sum of the recv-thread stages (queue_wait,
--   save_cpu_wait, save_npu_sync, gate_cond_wait, gate_npu_sync, meta_build, h2d_stagger,
--   slot_release_wait, backend_submit, completion); consumer_wait runs on the forward thread and is not
--   part of it. unexplained = total - explained: positive is a gap between stages, negative an overlap.
--   Tasks without ts_complete are listed with reason `incomplete`.
-- columns:
--   queue            VARCHAR  the recv FIFO
--   cfg_label        VARCHAR  configuration label
--   correlation_id   VARCHAR  the task
--   seq              BIGINT   seq in its queue
--   total_ms         DOUBLE   ts_complete - ts_enqueue, ms
--   explained_ms     DOUBLE   sum of recv-thread stage spans, ms
--   unexplained_ms   DOUBLE   total - explained, ms
--   unexplained_pct  DOUBLE   100 * unexplained / total
--   reason           VARCHAR  gap, overlap or incomplete
WITH per_task AS (
    SELECT queue, cfg_label, correlation_id, seq, ts_complete - ts_enqueue AS total_ns,
           coalesce(queue_wait_ns, 0) + coalesce(save_cpu_wait_ns, 0) + coalesce(save_npu_sync_ns, 0)
             + coalesce(gate_cond_wait_ns, 0) + coalesce(gate_npu_sync_ns, 0) + coalesce(meta_build_ns, 0)
             + coalesce(h2d_stagger_ns, 0) + coalesce(slot_release_wait_ns, 0)
             + coalesce(backend_submit_ns, 0) + coalesce(completion_ns, 0) AS explained_ns
    FROM tasks
)
SELECT queue, cfg_label, correlation_id, seq,
       total_ns / 1e6 AS total_ms,
       explained_ns / 1e6 AS explained_ms,
       (total_ns - explained_ns) / 1e6 AS unexplained_ms,
       100.0 * (total_ns - explained_ns) / nullif(total_ns, 0) AS unexplained_pct,
       CASE WHEN total_ns IS NULL THEN 'incomplete'
            WHEN total_ns - explained_ns > 0 THEN 'gap' ELSE 'overlap' END AS reason
FROM per_task
WHERE total_ns IS NULL
   OR abs(total_ns - explained_ns) > 0.01 * greatest(total_ns, 1)
ORDER BY total_ns IS NOT NULL, abs(total_ns - explained_ns) DESC, queue, seq
