-- name: timeline_hol
-- implements: docs/analysis.md (the report's timelines: HOL intervals drawn over the tasks)
-- requires: hol_intervals, timeline_windows
-- purpose: the HOL intervals the HTML timeline draws: those whose head lies in its queue's window.
-- definition:
--   An interval of hol_intervals whose head_seq lies in [lo, hi) of its queue's timeline_windows row,
--   earliest first.
-- columns:
--   queue                    VARCHAR  the recv FIFO
--   head_correlation_id      VARCHAR  the blocked head
--   class                    VARCHAR  proven or possible
--   start_ns                 BIGINT   interval start, epoch ns
--   end_ns                   BIGINT   interval end, epoch ns
--   evidence_correlation_id  VARCHAR  the ready task behind the head
--   evidence_ready_ns        BIGINT   when it was ready, epoch ns
SELECT h.queue, h.head_correlation_id, h.class, h.start_ns, h.end_ns, h.evidence_correlation_id,
       h.evidence_ready_ns
FROM hol_intervals AS h JOIN timeline_windows AS w
  ON h.queue = w.queue AND h.head_seq >= w.lo AND h.head_seq < w.hi
ORDER BY h.start_ns
