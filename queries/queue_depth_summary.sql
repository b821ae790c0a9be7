-- name: queue_depth_summary
-- implements: docs/analysis.md (report: queue depth)
-- requires: queue_depth
-- purpose: how deep each recv queue got: the report's queue-depth table.
-- definition:
--   Per queue over queue_depth's step series: the largest depth and in-flight count, and the mean depth
--   seen by arriving tasks (after each enqueue).
-- columns:
--   queue                  VARCHAR  the recv FIFO
--   cfg_label              VARCHAR  configuration label
--   path                   VARCHAR  gva or key
--   max_depth              BIGINT   most tasks queued at once
--   mean_depth_at_enqueue  DOUBLE   mean depth right after an enqueue
--   max_inflight           BIGINT   most tasks enqueued and not completed at once
SELECT queue, any_value(cfg_label) AS cfg_label, any_value(path) AS path,
       max(depth) AS max_depth, avg(depth) FILTER (WHERE event = 'enqueue') AS mean_depth_at_enqueue,
       max(inflight) AS max_inflight
FROM queue_depth GROUP BY queue ORDER BY queue
