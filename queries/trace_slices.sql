-- name: trace_slices
-- implements: docs/analysis.md (kvtrace export --perfetto: what each timeline track shows)
-- requires: tasks, spans
-- purpose: every task and stage as a slice on the thread that ran it, for timeline viewers (Perfetto,
--   chrome://tracing, MindStudio Insight): the recv thread's tasks with their stages nested inside, the
--   forward thread's consumer waits, the send thread's save tasks with their stages.
-- definition:
--   A recv task's slice on its recv thread runs from the first to the last end of its recv-thread stages
--   (every stage except queue_wait, which is time in the FIFO, and consumer_wait, which the forward
--   thread spends); its stages are level-1 slices inside it. The forward thread's consumer_wait is a
--   level-0 slice on that process's forward thread. A send task (kvtrace.send.task root) is a level-0
--   slice on its send thread from the first to the last end of its child spans other than queue_wait
--   (the root span when it has none), those children level-1 slices inside it. process is the queue id without its
--   thread name: recv, forward and send threads of one process share it.
-- columns:
--   run_id          VARCHAR  run
--   cfg_label       VARCHAR  configuration label
--   process         VARCHAR  {run_id}/{ranks}/pid{pid}: the process the thread belongs to
--   queue           VARCHAR  recv FIFO (the send thread's kvtrace.queue for send slices)
--   thread          VARCHAR  recv, forward or send
--   correlation_id  VARCHAR  the task
--   seq             BIGINT   the task's position in its queue
--   step            BIGINT   forward step
--   layer_id        BIGINT   layer
--   name            VARCHAR  task (level 0 on recv), consumer_wait, kvtrace.send.task or a stage name
--   level           INTEGER  0 for a task slice, 1 for a stage inside it
--   start_ns        BIGINT   slice start, epoch ns
--   end_ns          BIGINT   slice end, epoch ns
--   outcome         VARCHAR  the task's outcome (recv tasks)
WITH recv_stages AS (
    UNPIVOT (SELECT run_id, cfg_label, queue, correlation_id, seq, step, layer_id, outcome,
                    save_cpu_wait_start, save_cpu_wait_end, save_npu_sync_start, save_npu_sync_end,
                    gate_cond_wait_start, gate_cond_wait_end, gate_npu_sync_start, gate_npu_sync_end,
                    meta_build_start, meta_build_end, h2d_stagger_start, h2d_stagger_end,
                    slot_release_wait_start, slot_release_wait_end, backend_submit_start, backend_submit_end,
                    completion_start, completion_end
             FROM tasks)
    ON (save_cpu_wait_start, save_cpu_wait_end) AS save_cpu_wait,
       (save_npu_sync_start, save_npu_sync_end) AS save_npu_sync,
       (gate_cond_wait_start, gate_cond_wait_end) AS gate_cond_wait,
       (gate_npu_sync_start, gate_npu_sync_end) AS gate_npu_sync,
       (meta_build_start, meta_build_end) AS meta_build,
       (h2d_stagger_start, h2d_stagger_end) AS h2d_stagger,
       (slot_release_wait_start, slot_release_wait_end) AS slot_release_wait,
       (backend_submit_start, backend_submit_end) AS backend_submit,
       (completion_start, completion_end) AS completion
    INTO NAME name VALUE start_ns, end_ns
),
recv AS (
    SELECT run_id, cfg_label, regexp_replace(queue, '/[^/]*$', '') AS process, queue, 'recv' AS thread,
           correlation_id, seq, step, layer_id, name, 1 AS level, start_ns, end_ns, outcome
    FROM recv_stages WHERE start_ns IS NOT NULL AND end_ns IS NOT NULL
),
recv_tasks AS (
    SELECT run_id, cfg_label, process, queue, thread, correlation_id, seq, step, layer_id, 'task' AS name,
           0 AS level, min(start_ns) AS start_ns, max(end_ns) AS end_ns, any_value(outcome) AS outcome
    FROM recv GROUP BY run_id, cfg_label, process, queue, thread, correlation_id, seq, step, layer_id
),
forward AS (
    SELECT run_id, cfg_label, regexp_replace(queue, '/[^/]*$', ''), queue, 'forward', correlation_id, seq,
           step, layer_id, 'consumer_wait', 0, consumer_wait_start, consumer_wait_end, outcome
    FROM tasks WHERE consumer_wait_start IS NOT NULL AND consumer_wait_end IS NOT NULL
),
send_roots AS (
    SELECT trace_id, run_id, cfg_label, attrs['kvtrace.queue'] AS queue, correlation_id,
           TRY_CAST(attrs['kvtrace.seq'] AS BIGINT) AS seq, TRY_CAST(attrs['kvtrace.step'] AS BIGINT) AS step,
           TRY_CAST(attrs['kvtrace.layer_id'] AS BIGINT) AS layer_id, name, start_ns, end_ns
    FROM spans WHERE name = 'kvtrace.send.task' AND parent_span_id IS NULL AND queue IS NOT NULL
),
send_stages AS (
    SELECT r.run_id, r.cfg_label, regexp_replace(r.queue, '/[^/]*$', '') AS process, r.queue, 'send' AS thread,
           r.correlation_id, r.seq, r.step, r.layer_id, c.name, 1 AS level, c.start_ns, c.end_ns,
           NULL AS outcome
    FROM send_roots AS r JOIN spans AS c ON c.trace_id = r.trace_id AND c.parent_span_id IS NOT NULL
    WHERE c.name <> 'queue_wait'
),
send AS (
    SELECT r.run_id, r.cfg_label, regexp_replace(r.queue, '/[^/]*$', ''), r.queue, 'send', r.correlation_id,
           r.seq, r.step, r.layer_id, r.name, 0, coalesce(min(c.start_ns), r.start_ns),
           coalesce(max(c.end_ns), r.end_ns), NULL
    FROM send_roots AS r LEFT JOIN send_stages AS c USING (correlation_id)
    GROUP BY r.run_id, r.cfg_label, r.queue, r.correlation_id, r.seq, r.step, r.layer_id, r.name, r.start_ns,
             r.end_ns
    UNION ALL
    SELECT * FROM send_stages
)
SELECT * FROM recv_tasks UNION ALL SELECT * FROM recv UNION ALL SELECT * FROM forward UNION ALL SELECT * FROM send
ORDER BY process, queue, thread, start_ns, level
