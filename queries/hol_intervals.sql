-- name: hol_intervals
-- implements: docs/analysis.md, "HOL definition"
-- requires: tasks, spans
-- purpose: every interval in which a recv queue's head task waits on a dependency while a later task of
--   the same queue and step could legally have been served: head-of-line blocking, with the task that
--   proves it.
-- definition:
--   For each task h, each of its dependency-wait spans (save_cpu_wait, save_npu_sync, gate_cond_wait,
--   gate_npu_sync, slot_release_wait) is a wait window W (W_h may be several disjoint windows). A later
--   task j of the same queue and the same step (seq_j > seq_h, step_j = step_h) is bypass-ready at time t
--   when ts_enqueue_j <= t, ts_ready_j <= t and j is not the step's final-layer task (it releases every
--   layer's leases, so it may never go first). HOL is within a step: since that final-layer task releases
--   the step's leases, a task of a later step can never legally pass h. h is blocked at t only while its
--   own dependencies are unmet (t < ts_ready_h): a wait span that runs past ts_ready_h (the wait call's
--   own overhead, the wake-up after the producer's set()) is not head-of-line blocking. The HOL interval
--   of h is the union over such j of [max(start(W), ts_enqueue_j, ts_ready_j), min(end(W), ts_ready_h)).
--   All those intervals end at the same point, so the union is
--   [max(start(W), R_h), min(end(W), ts_ready_h)) with R_h = min over later non-final j of the step of
--   max(ts_enqueue_j, ts_ready_j); the evidence is the j attaining R_h (earliest ready; lowest seq on ties).
--   Bounded NPU times: class `proven` holds where j is surely ready (its upper bound ts_ready_j <= t) and
--   h surely is not (t < its lower bound ts_ready_lo_h); class `possible` is the rest of the instants
--   where j may be ready (ts_ready_lo_j <= t) and h may not (t < ts_ready_h). Exact tasks have
--   ts_ready_lo NULL and use ts_ready for both bounds. A waiting head with nothing ready behind it has
--   no row. Each window is clipped to those intervals, then the pieces of one head and class are merged
--   (gaps and islands), so a row is a maximal interval: overlapping or touching windows never produce
--   overlapping or touching rows. (The original design did not clip at ts_ready_h; docs/analysis.md
--   says why we do.)
-- columns:
--   queue                    VARCHAR  the recv FIFO (tasks.queue)
--   cfg_label                VARCHAR  configuration label of the head's process
--   path                     VARCHAR  gva or key
--   run_id                   VARCHAR  run of the head's process
--   head_correlation_id      VARCHAR  the blocked head task h
--   head_seq                 BIGINT   seq of h in its queue
--   head_step                BIGINT   forward step of h
--   head_layer_id            BIGINT   layer h loads
--   class                    VARCHAR  proven or possible
--   start_ns                 BIGINT   interval start, epoch ns
--   end_ns                   BIGINT   interval end (exclusive), epoch ns
--   dur_ns                   BIGINT   end_ns - start_ns
--   wait_start_ns            BIGINT   start of the first wait span the interval lies in
--   wait_end_ns              BIGINT   end of the last wait span the interval lies in
--   evidence_correlation_id  VARCHAR  the earliest bypass-ready later task j (same queue and step)
--   evidence_seq             BIGINT   seq of j
--   evidence_ready_ns        BIGINT   max(ts_enqueue_j, ts_ready_j) (ts_ready_lo_j for class possible)
WITH ready AS (
    -- When each task could go first, by upper bound (hi) and lower bound (lo); NULL when it never may.
    -- own_lo/own_hi: until when the task itself surely / possibly still waits for a dependency.
    SELECT trace_id, queue, cfg_label, path, run_id, correlation_id, seq, step, layer_id,
           CASE WHEN NOT coalesce(final_layer, false) THEN greatest(ts_enqueue, ts_ready) END AS ready_hi,
           CASE WHEN NOT coalesce(final_layer, false)
                THEN greatest(ts_enqueue, coalesce(ts_ready_lo, ts_ready)) END AS ready_lo,
           coalesce(greatest(ts_enqueue, coalesce(ts_ready_lo, ts_ready)), 9223372036854775807) AS own_lo,
           coalesce(greatest(ts_enqueue, ts_ready), 9223372036854775807) AS own_hi
    FROM tasks
),
heads AS (
    -- For each head: the earliest bypass-ready later task of its queue and step, as (ready time, seq), by
    -- upper and by lower bound (a suffix minimum over seq; struct order breaks ties by the lower seq).
    SELECT * FROM (
        SELECT *,
               min(CASE WHEN ready_hi IS NOT NULL THEN {'ready': ready_hi, 'seq': seq} END) OVER later AS ev_hi,
               min(CASE WHEN ready_lo IS NOT NULL THEN {'ready': ready_lo, 'seq': seq} END) OVER later AS ev_lo
        FROM ready
        WINDOW later AS (PARTITION BY queue, step ORDER BY seq DESC
                         ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    ) WHERE ev_lo IS NOT NULL
),
waits AS (
    SELECT trace_id, start_ns AS ws, end_ns AS we
    FROM spans
    WHERE name IN ('save_cpu_wait', 'save_npu_sync', 'gate_cond_wait', 'gate_npu_sync', 'slot_release_wait')
      AND end_ns > start_ns
),
candidates AS (
    -- Per window: proven part [p1, p2); proven-or-possible part [a1, a2). Windows with neither are dropped.
    SELECT * FROM (
        SELECT h.*, w.ws, w.we,
               greatest(w.ws, h.ev_hi.ready) AS p1, least(w.we, h.own_lo) AS p2,
               greatest(w.ws, h.ev_lo.ready) AS a1, least(w.we, h.own_hi) AS a2
        FROM heads AS h JOIN waits AS w USING (trace_id)
    ) WHERE a1 < a2
),
pieces AS (
    -- possible = [a1, a2) minus the head's proven set [ev_hi.ready, own_lo), which splits it in up to two.
    SELECT * FROM (
        SELECT * EXCLUDE (piece), piece.class AS class, piece.s AS start_ns, piece.e AS end_ns
        FROM (SELECT *, unnest([
                  {'class': 'proven', 's': p1, 'e': p2},
                  {'class': 'possible', 's': a1, 'e': least(a2, greatest(ev_hi.ready, a1))},
                  {'class': 'possible', 's': greatest(a1, own_lo, ev_hi.ready), 'e': a2}]) AS piece
              FROM candidates)
    ) WHERE start_ns < end_ns
),
marked AS (
    -- Gaps and islands: a piece starts a new interval unless it begins at or before an earlier one's end.
    SELECT *,
           CASE WHEN start_ns <= max(end_ns) OVER (PARTITION BY trace_id, class ORDER BY start_ns, end_ns
                                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                THEN 0 ELSE 1 END AS new_island
    FROM pieces
),
islands AS (
    SELECT *, sum(new_island) OVER (PARTITION BY trace_id, class ORDER BY start_ns, end_ns
                                    ROWS UNBOUNDED PRECEDING) AS island
    FROM marked
),
intervals AS (
    SELECT any_value(queue) AS queue, any_value(cfg_label) AS cfg_label, any_value(path) AS path,
           any_value(run_id) AS run_id, any_value(correlation_id) AS head_correlation_id,
           any_value(seq) AS head_seq, any_value(step) AS head_step, any_value(layer_id) AS head_layer_id,
           class, min(start_ns) AS start_ns, max(end_ns) AS end_ns, min(ws) AS wait_start_ns,
           max(we) AS wait_end_ns,
           any_value(CASE class WHEN 'proven' THEN ev_hi ELSE ev_lo END) AS ev
    FROM islands
    GROUP BY trace_id, class, island
)
SELECT i.queue, i.cfg_label, i.path, i.run_id, i.head_correlation_id, i.head_seq, i.head_step,
       i.head_layer_id, i.class, i.start_ns, i.end_ns, i.end_ns - i.start_ns AS dur_ns,
       i.wait_start_ns, i.wait_end_ns, e.correlation_id AS evidence_correlation_id,
       i.ev.seq AS evidence_seq, i.ev.ready AS evidence_ready_ns
FROM intervals AS i
JOIN tasks AS e ON e.queue = i.queue AND e.step IS NOT DISTINCT FROM i.head_step AND e.seq = i.ev.seq
ORDER BY i.queue, i.head_seq, i.start_ns
