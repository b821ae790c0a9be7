-- name: queue_depth
-- implements: docs/schema.md, child spans (queue_wait, ts.enqueue/ts.dequeue/ts.complete)
-- requires: tasks
-- purpose: the depth of every recv queue over time: how many tasks wait in the FIFO and how many are in
--   flight (enqueued, not completed), as a step series with one row per enqueue, dequeue or completion.
-- definition:
--   depth = enqueues - dequeues so far; inflight = enqueues - completions so far. Events at equal
--   timestamps apply in the order enqueue, dequeue, complete (then by seq), so a count never goes negative.
-- columns:
--   queue           VARCHAR  the recv FIFO
--   cfg_label       VARCHAR  configuration label
--   path            VARCHAR  gva or key
--   run_id          VARCHAR  run
--   ts_ns           BIGINT   time of the event, epoch ns
--   event           VARCHAR  enqueue, dequeue or complete
--   correlation_id  VARCHAR  task the event belongs to
--   seq             BIGINT   seq of that task
--   depth           BIGINT   tasks queued (enqueued, not dequeued) after the event
--   inflight        BIGINT   tasks enqueued and not completed after the event
WITH events AS (
    SELECT queue, cfg_label, path, run_id, ts_enqueue AS ts_ns, 'enqueue' AS event, correlation_id, seq,
           1 AS d_depth, 1 AS d_inflight, 0 AS tie FROM tasks WHERE ts_enqueue IS NOT NULL
    UNION ALL
    SELECT queue, cfg_label, path, run_id, ts_dequeue, 'dequeue', correlation_id, seq, -1, 0, 1
    FROM tasks WHERE ts_dequeue IS NOT NULL
    UNION ALL
    SELECT queue, cfg_label, path, run_id, ts_complete, 'complete', correlation_id, seq, 0, -1, 2
    FROM tasks WHERE ts_complete IS NOT NULL
)
SELECT queue, cfg_label, path, run_id, ts_ns, event, correlation_id, seq,
       sum(d_depth) OVER w AS depth,
       sum(d_inflight) OVER w AS inflight
FROM events
WINDOW w AS (PARTITION BY queue ORDER BY ts_ns, tie, seq ROWS UNBOUNDED PRECEDING)
ORDER BY queue, ts_ns, tie, seq
