-- name: hol_events
-- implements: docs/analysis.md (HOL definition; an event is a blocked head)
-- requires: hol_intervals
-- purpose: one row per HOL event: a head task and every interval in which it blocked a ready task behind
--   it, with the evidence of its first interval. The summary, the plots, the HTML page and the Perfetto
--   export count events from here.
-- definition:
--   An event is a head h of hol_intervals (per queue). Its duration is the sum of its intervals (they
--   never overlap); it is proven when at least one of its intervals is proven. first_* describe the
--   earliest interval and its evidence task.
-- columns:
--   queue                    VARCHAR  the recv FIFO
--   cfg_label                VARCHAR  configuration label
--   path                     VARCHAR  gva or key
--   run_id                   VARCHAR  run
--   head_correlation_id      VARCHAR  the blocked head
--   head_seq                 BIGINT   seq of the head in its queue
--   head_step                BIGINT   forward step of the head
--   head_layer_id            BIGINT   layer the head loads
--   class                    VARCHAR  proven when any interval is proven, else possible
--   intervals                BIGINT   number of intervals
--   start_ns                 BIGINT   start of the first interval, epoch ns
--   end_ns                   BIGINT   end of the last interval, epoch ns
--   dur_ns                   BIGINT   sum of the intervals
--   proven_ns                BIGINT   sum of the proven intervals (NULL when none)
--   first_end_ns             BIGINT   end of the first interval, epoch ns
--   evidence_correlation_id  VARCHAR  evidence task of the first interval
--   evidence_seq             BIGINT   its seq
--   evidence_ready_ns        BIGINT   when it was ready, epoch ns
SELECT queue, any_value(cfg_label) AS cfg_label, any_value(path) AS path, any_value(run_id) AS run_id,
       head_correlation_id, any_value(head_seq) AS head_seq, any_value(head_step) AS head_step,
       any_value(head_layer_id) AS head_layer_id,
       CASE WHEN bool_or(class = 'proven') THEN 'proven' ELSE 'possible' END AS class,
       count(*) AS intervals, min(start_ns) AS start_ns, max(end_ns) AS end_ns, sum(dur_ns) AS dur_ns,
       sum(dur_ns) FILTER (WHERE class = 'proven') AS proven_ns,
       arg_min(end_ns, start_ns) AS first_end_ns,
       arg_min(evidence_correlation_id, start_ns) AS evidence_correlation_id,
       arg_min(evidence_seq, start_ns) AS evidence_seq,
       arg_min(evidence_ready_ns, start_ns) AS evidence_ready_ns
FROM hol_intervals
GROUP BY queue, head_correlation_id
ORDER BY queue, start_ns
