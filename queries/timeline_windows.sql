-- name: timeline_windows
-- implements: docs/analysis.md (the report's timelines: which queues and which tasks are drawn)
-- requires: tasks, hol_intervals
-- purpose: the queues the HTML/PNG timelines draw and, per queue, the window of consecutive tasks (by
--   seq) around its longest HOL interval; queues with the most HOL time first.
-- definition:
--   At most timeline_queues queues, ordered by their total HOL interval time (queues without HOL last),
--   then by task count, then by name. Each gets per_queue = max(20, timeline_tasks // queues shown)
--   tasks: seq in [lo, hi), centred on the head of its longest HOL interval (on per_queue // 2 when it
--   has none), never below seq 0.
-- parameters:
--   timeline_tasks   BIGINT   tasks drawn over every queue (default 1500), SET VARIABLE timeline_tasks
--   timeline_queues  BIGINT   queues drawn at most (default 8), SET VARIABLE timeline_queues
-- columns:
--   queue        VARCHAR  the recv FIFO
--   rank         BIGINT   its position in the timeline (1 = most HOL)
--   lo           BIGINT   first seq drawn
--   hi           BIGINT   seq after the last one drawn
--   total_tasks  BIGINT   tasks in the tasks table (the same on every row)
WITH hol AS (
    SELECT queue, sum(dur_ns) AS hol_ns, arg_max(head_seq, dur_ns) AS center FROM hol_intervals GROUP BY queue
), ranked AS (
    SELECT t.queue, any_value(h.center) AS center,
           row_number() OVER (ORDER BY any_value(h.hol_ns) DESC NULLS LAST, count(*) DESC, t.queue) AS rank
    FROM tasks AS t LEFT JOIN hol AS h USING (queue)
    GROUP BY t.queue
    QUALIFY rank <= coalesce(getvariable('timeline_queues'), 8)
), sized AS (
    SELECT queue, rank, center,
           greatest(20, coalesce(getvariable('timeline_tasks'), 1500) // count(*) OVER ()) AS per_queue
    FROM ranked
)
SELECT queue, rank,
       greatest(0, coalesce(center, per_queue // 2) - per_queue // 2) AS lo,
       greatest(0, coalesce(center, per_queue // 2) - per_queue // 2) + per_queue AS hi,
       (SELECT count(*) FROM tasks) AS total_tasks
FROM sized
ORDER BY rank
