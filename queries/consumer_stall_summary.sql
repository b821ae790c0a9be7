-- name: consumer_stall_summary
-- implements: docs/analysis.md (report: consumer stall per step)
-- requires: consumer_stall
-- purpose: what the forward thread paid per step, per configuration: the report's consumer-stall table.
-- definition:
--   A step's wait is the sum of its layers' consumer waits (per queue); the percentiles are over steps.
-- columns:
--   cfg_label       VARCHAR  configuration label
--   path            VARCHAR  gva or key
--   steps           BIGINT   steps (per queue)
--   total_wait_ms   DOUBLE   sum of every consumer wait, ms
--   after_ready_ms  DOUBLE   the part after the task was ready, ms
--   step_p50_ms     DOUBLE   median step wait, ms
--   step_p95_ms     DOUBLE   95th percentile step wait, ms
--   step_p99_ms     DOUBLE   99th percentile step wait, ms
--   step_max_ms     DOUBLE   longest step wait, ms
WITH steps AS (
    SELECT cfg_label, path, queue, step, sum(wait_ms) AS wait_ms, sum(stall_after_ready_ms) AS after_ready_ms
    FROM consumer_stall GROUP BY ALL)
SELECT cfg_label, path, count(*) AS steps, sum(wait_ms) AS total_wait_ms,
       sum(after_ready_ms) AS after_ready_ms,
       quantile_cont(wait_ms, 0.5) AS step_p50_ms, quantile_cont(wait_ms, 0.95) AS step_p95_ms,
       quantile_cont(wait_ms, 0.99) AS step_p99_ms, max(wait_ms) AS step_max_ms
FROM steps GROUP BY ALL ORDER BY cfg_label, path
