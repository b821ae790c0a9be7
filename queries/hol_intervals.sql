-- name: hol_intervals
-- implements: design.md section 4 (HOL definition)
-- requires: tasks, spans
-- purpose: every interval in which a recv queue's head task waits on a dependency while a later task of
--   the same queue could legally have been served: head-of-line blocking, with the task that proves it.
-- definition:
--   For each task h, each of its dependency-wait spans (save_cpu_wait, save_npu_sync, gate_cond_wait,
--   gate_npu_sync, slot_release_wait) is a wait window; overlapping or touching windows of one head are
--   merged (W_h may be several disjoint windows). A later task j of the same queue (seq_j > seq_h) is
--   bypass-ready at time t when ts_enqueue_j <= t, ts_ready_j <= t and j is not the step's final-layer
--   task (it releases every layer's leases, so it may never go first). h is blocked at t only while its
--   own dependencies are unmet (t < ts_ready_h): a wait span that runs past ts_ready_h (the wait call's
--   own overhead, the wake-up after the producer's set()) is not head-of-line blocking. The HOL interval
--   of h is the union over such j of [max(start(W), ts_enqueue_j, ts_ready_j), min(end(W), ts_ready_h)).
--   All those intervals end at the same point, so the union is
--   [max(start(W), R_h), min(end(W), ts_ready_h)) with R_h = min over later non-final j of
--   max(ts_enqueue_j, ts_ready_j); the evidence is the j attaining R_h (earliest ready; lowest seq on ties).
--   Bounded NPU times: class `proven` holds where j is surely ready (its upper bound ts_ready_j <= t) and
--   h surely is not (t < its lower bound ts_ready_lo_h); class `possible` is the rest of the instants
--   where j may be ready (ts_ready_lo_j <= t) and h may not (t < ts_ready_h). Exact tasks have
--   ts_ready_lo NULL and use ts_ready for both bounds. A waiting head with nothing ready behind it has
--   no row. (design.md section 4 does not clip at ts_ready_h; see docs/analysis.md for why we do.)
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
--   wait_start_ns            BIGINT   start of the merged wait window W the interval lies in
--   wait_end_ns              BIGINT   end of that window
--   evidence_correlation_id  VARCHAR  the earliest bypass-ready later task j
--   evidence_seq             BIGINT   seq of j
--   evidence_ready_ns        BIGINT   max(ts_enqueue_j, ts_ready_j) (ts_ready_lo_j for class possible)
WITH ready AS (
    -- When each task could go first, by upper bound (hi) and lower bound (lo); NULL when it never may.
    SELECT queue, seq, correlation_id,
           CASE WHEN NOT coalesce(final_layer, false) THEN greatest(ts_enqueue, ts_ready) END AS ready_hi,
           CASE WHEN NOT coalesce(final_layer, false)
                THEN greatest(ts_enqueue, coalesce(ts_ready_lo, ts_ready)) END AS ready_lo
    FROM tasks
),
earliest_later AS (
    -- For each head: the earliest bypass-ready later task of its queue (a suffix minimum over seq).
    SELECT queue, seq,
           arg_min({'cid': correlation_id, 'seq': seq, 'ready': ready_hi},
                   CASE WHEN ready_hi IS NOT NULL THEN (ready_hi, seq) END) OVER later AS ev_hi,
           arg_min({'cid': correlation_id, 'seq': seq, 'ready': ready_lo},
                   CASE WHEN ready_lo IS NOT NULL THEN (ready_lo, seq) END) OVER later AS ev_lo
    FROM ready
    WINDOW later AS (PARTITION BY queue ORDER BY seq DESC ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
),
heads AS (
    -- own_lo/own_hi: until when the head itself is surely / possibly still waiting for a dependency.
    SELECT t.trace_id, t.queue, t.cfg_label, t.path, t.run_id, t.correlation_id, t.seq, t.step, t.layer_id,
           coalesce(greatest(t.ts_enqueue, coalesce(t.ts_ready_lo, t.ts_ready)), 9223372036854775807) AS own_lo,
           coalesce(greatest(t.ts_enqueue, t.ts_ready), 9223372036854775807) AS own_hi,
           e.ev_hi, e.ev_lo
    FROM tasks AS t JOIN earliest_later AS e USING (queue, seq)
    WHERE e.ev_lo.ready IS NOT NULL
),
waits AS (
    SELECT trace_id, start_ns AS ws, end_ns AS we
    FROM spans
    WHERE name IN ('save_cpu_wait', 'save_npu_sync', 'gate_cond_wait', 'gate_npu_sync', 'slot_release_wait')
      AND end_ns > start_ns
),
marked AS (
    -- Gaps and islands: a window starts a new island unless it begins at or before an earlier one's end.
    SELECT trace_id, ws, we,
           CASE WHEN ws <= max(we) OVER (PARTITION BY trace_id ORDER BY ws, we
                                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                THEN 0 ELSE 1 END AS new_island
    FROM waits
),
islands AS (
    SELECT trace_id, ws, we,
           sum(new_island) OVER (PARTITION BY trace_id ORDER BY ws, we ROWS UNBOUNDED PRECEDING) AS island
    FROM marked
),
windows AS (
    SELECT trace_id, min(ws) AS ws, max(we) AS we FROM islands GROUP BY trace_id, island
),
candidates AS (
    -- proven: [p1, p2); proven or possible: [a1, a2); possible = [a1, a2) minus [p1, p2).
    SELECT h.*, w.ws, w.we,
           greatest(w.ws, h.ev_hi.ready) AS p1, least(w.we, h.own_lo) AS p2,
           greatest(w.ws, h.ev_lo.ready) AS a1, least(w.we, h.own_hi) AS a2
    FROM heads AS h JOIN windows AS w USING (trace_id)
),
classified AS (
    SELECT *, 'proven' AS class, p1 AS start_ns, p2 AS end_ns, ev_hi AS ev
    FROM candidates WHERE p1 < p2
    UNION ALL  -- possible, when nothing is proven in this window
    SELECT *, 'possible', a1, a2, ev_lo FROM candidates WHERE a1 < a2 AND NOT p1 < p2
    UNION ALL  -- possible, before the proven part
    SELECT *, 'possible', a1, p1, ev_lo FROM candidates WHERE p1 < p2 AND a1 < p1
    UNION ALL  -- possible, after the proven part
    SELECT *, 'possible', p2, a2, ev_lo FROM candidates WHERE p1 < p2 AND p2 < a2
)
SELECT queue, cfg_label, path, run_id,
       correlation_id AS head_correlation_id, seq AS head_seq, step AS head_step, layer_id AS head_layer_id,
       class, start_ns, end_ns, end_ns - start_ns AS dur_ns, ws AS wait_start_ns, we AS wait_end_ns,
       ev.cid AS evidence_correlation_id, ev.seq AS evidence_seq, ev.ready AS evidence_ready_ns
FROM classified
ORDER BY queue, head_seq, start_ns
