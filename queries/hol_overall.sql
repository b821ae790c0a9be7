-- name: hol_overall
-- implements: docs/analysis.md (HOL definition; an event is a blocked head)
-- requires: hol_events
-- purpose: the HOL events of every configuration together, counted exactly as hol_summary counts them
--   per configuration: the report's one-line answer.
-- definition:
--   One row over hol_events: counts by class, total durations, and percentiles of the per-event
--   duration (the sum of the head's intervals).
-- columns:
--   events           BIGINT  HOL events (heads with any interval)
--   proven_events    BIGINT  events with a proven interval
--   possible_events  BIGINT  events whose HOL is only possible
--   total_ms         DOUBLE  sum of every event's duration, ms
--   proven_total_ms  DOUBLE  sum of the proven intervals, ms
--   p50_ms           DOUBLE  median event duration, ms
--   p95_ms           DOUBLE  95th percentile event duration, ms
--   p99_ms           DOUBLE  99th percentile event duration, ms
--   max_ms           DOUBLE  longest event, ms
SELECT count(*) AS events, count(proven_ns) AS proven_events, count(*) - count(proven_ns) AS possible_events,
       coalesce(sum(dur_ns), 0) / 1e6 AS total_ms, coalesce(sum(proven_ns), 0) / 1e6 AS proven_total_ms,
       quantile_cont(dur_ns, 0.5) / 1e6 AS p50_ms, quantile_cont(dur_ns, 0.95) / 1e6 AS p95_ms,
       quantile_cont(dur_ns, 0.99) / 1e6 AS p99_ms, max(dur_ns) / 1e6 AS max_ms
FROM hol_events
