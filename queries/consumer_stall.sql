-- name: consumer_stall
-- implements: docs/schema.md, child spans (consumer_wait: the stall TTFT pays)
-- requires: tasks
-- purpose: how long the forward thread waited for each layer's KV load, per step and layer, and what
--   that wait sums to per step.
-- definition:
--   consumer_wait is the forward thread's wait_for_layer_load for the task's layer. stall_after_ready_ms
--   is the part of that wait after the task was ready (its dependencies met): time the consumer lost to
--   the recv queue and backend rather than to the producer.
-- columns:
--   queue                 VARCHAR  the recv FIFO
--   cfg_label             VARCHAR  configuration label
--   path                  VARCHAR  gva or key
--   run_id                VARCHAR  run
--   step                  BIGINT   forward step
--   layer_id              BIGINT   layer
--   correlation_id        VARCHAR  the task
--   wait_start_ns         BIGINT   consumer wait start, epoch ns
--   wait_end_ns           BIGINT   consumer wait end, epoch ns
--   wait_ms               DOUBLE   consumer wait, ms
--   stall_after_ready_ms  DOUBLE   part of the wait after ts_ready, ms
--   step_wait_ms          DOUBLE   consumer wait summed over the step's layers, ms
SELECT queue, cfg_label, path, run_id, step, layer_id, correlation_id,
       consumer_wait_start AS wait_start_ns, consumer_wait_end AS wait_end_ns,
       consumer_wait_ns / 1e6 AS wait_ms,
       greatest(0, consumer_wait_end - greatest(consumer_wait_start, ts_ready)) / 1e6 AS stall_after_ready_ms,
       sum(consumer_wait_ns) OVER (PARTITION BY queue, step) / 1e6 AS step_wait_ms
FROM tasks
WHERE consumer_wait_ns IS NOT NULL
ORDER BY queue, step, layer_id
