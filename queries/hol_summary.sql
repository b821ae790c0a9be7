-- name: hol_summary
-- implements: docs/analysis.md, "HOL definition" (HOL events and their share of dependency wait)
-- requires: hol_events, tasks
-- purpose: how often and how long head-of-line blocking happens, per configuration and path.
-- definition:
--   A HOL event is a head task with at least one row in hol_intervals (any class); a proven event has a
--   proven row. An event's duration is the sum of its intervals (of the class counted). dep_wait_ms is the
--   total of the five dependency-wait stages (save_cpu_wait, save_npu_sync, gate_cond_wait,
--   gate_npu_sync, slot_release_wait) over all tasks; hol_share is proven HOL time / dep wait time.
-- columns:
--   cfg_label           VARCHAR  configuration label
--   path                VARCHAR  gva or key
--   tasks               BIGINT   recv tasks
--   waiting_tasks       BIGINT   tasks with a dependency wait > 0
--   hol_events          BIGINT   heads with any HOL interval (proven or possible)
--   proven_events       BIGINT   heads with a proven HOL interval
--   possible_events     BIGINT   heads whose HOL is only possible (no proven interval)
--   hol_total_ms        DOUBLE   sum of all HOL interval durations, ms
--   proven_total_ms     DOUBLE   sum of proven HOL interval durations, ms
--   p50_ms              DOUBLE   median per-event HOL duration (all classes), ms
--   p95_ms              DOUBLE   95th percentile per-event HOL duration, ms
--   p99_ms              DOUBLE   99th percentile per-event HOL duration, ms
--   max_ms              DOUBLE   longest per-event HOL duration, ms
--   dep_wait_ms         DOUBLE   total dependency wait, ms
--   hol_share           DOUBLE   proven_total_ms / dep_wait_ms (NULL when there is no wait)
WITH per_task AS (
    SELECT cfg_label, path,
           coalesce(save_cpu_wait_ns, 0) + coalesce(save_npu_sync_ns, 0) + coalesce(gate_cond_wait_ns, 0)
             + coalesce(gate_npu_sync_ns, 0) + coalesce(slot_release_wait_ns, 0) AS dep_wait_ns
    FROM tasks
),
base AS (
    SELECT cfg_label, path, count(*) AS tasks, count(*) FILTER (WHERE dep_wait_ns > 0) AS waiting_tasks,
           sum(dep_wait_ns) AS dep_wait_ns
    FROM per_task GROUP BY cfg_label, path
),
events AS (  -- one row per HOL event (hol_events.sql: the one definition of an event)
    SELECT cfg_label, path, queue, head_correlation_id, dur_ns AS hol_ns, proven_ns FROM hol_events
),
agg AS (
    SELECT cfg_label, path,
           count(*) AS hol_events,
           count(proven_ns) AS proven_events,
           sum(hol_ns) / 1e6 AS hol_total_ms,
           coalesce(sum(proven_ns), 0) / 1e6 AS proven_total_ms,
           quantile_cont(hol_ns, 0.5) / 1e6 AS p50_ms,
           quantile_cont(hol_ns, 0.95) / 1e6 AS p95_ms,
           quantile_cont(hol_ns, 0.99) / 1e6 AS p99_ms,
           max(hol_ns) / 1e6 AS max_ms
    FROM events GROUP BY cfg_label, path
)
SELECT b.cfg_label, b.path, b.tasks, b.waiting_tasks,
       coalesce(a.hol_events, 0) AS hol_events,
       coalesce(a.proven_events, 0) AS proven_events,
       coalesce(a.hol_events, 0) - coalesce(a.proven_events, 0) AS possible_events,
       coalesce(a.hol_total_ms, 0.0) AS hol_total_ms,
       coalesce(a.proven_total_ms, 0.0) AS proven_total_ms,
       a.p50_ms, a.p95_ms, a.p99_ms, a.max_ms,
       b.dep_wait_ns / 1e6 AS dep_wait_ms,
       CASE WHEN b.dep_wait_ns > 0 THEN coalesce(a.proven_total_ms, 0.0) / (b.dep_wait_ns / 1e6) END AS hol_share
FROM base AS b LEFT JOIN agg AS a USING (cfg_label, path)
ORDER BY b.cfg_label, b.path
