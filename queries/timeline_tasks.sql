-- name: timeline_tasks
-- implements: docs/analysis.md (the report's timelines: one bar per task, its stages inside)
-- requires: tasks, timeline_windows
-- purpose: the tasks the HTML/PNG timelines draw: every task inside its queue's window, with its stage
--   times and dependency times.
-- definition:
--   A task of queue q is drawn when lo <= seq < hi for q's row of timeline_windows. Times are epoch ns;
--   the report turns them into microseconds from the first task shown of each run.
-- columns:
--   queue                    VARCHAR  the recv FIFO
--   seq                      BIGINT   position in the queue
--   correlation_id           VARCHAR  the task
--   step                     BIGINT   forward step
--   layer_id                 BIGINT   layer
--   final_layer              BOOLEAN  last layer of the step
--   outcome                  VARCHAR  the task's outcome
--   ready_precision          VARCHAR  exact or bounded
--   run_id                   VARCHAR  run
--   cfg_label                VARCHAR  configuration label
--   wait_for_save_layer      BIGINT   layer whose save the task waits for
--   gate_id                  BIGINT   attention gate
--   cfg_num_shared_buffers   BIGINT   shared buffers
--   cfg_num_layers           BIGINT   layers
--   cfg_independent_layers   VARCHAR  independent layers
--   trace_id                 VARCHAR  the task's trace id
--   ts_enqueue               BIGINT   enqueued, epoch ns
--   ts_dequeue               BIGINT   dequeued, epoch ns
--   ts_ready                 BIGINT   ready, epoch ns
--   ts_ready_lo              BIGINT   earliest possible ready, epoch ns
--   ts_complete              BIGINT   completed, epoch ns
--   queue_wait_start         BIGINT   queue_wait stage start, epoch ns
--   queue_wait_end           BIGINT   queue_wait stage end, epoch ns
--   save_cpu_wait_start      BIGINT   save_cpu_wait stage start, epoch ns
--   save_cpu_wait_end        BIGINT   save_cpu_wait stage end, epoch ns
--   save_npu_sync_start      BIGINT   save_npu_sync stage start, epoch ns
--   save_npu_sync_end        BIGINT   save_npu_sync stage end, epoch ns
--   gate_cond_wait_start     BIGINT   gate_cond_wait stage start, epoch ns
--   gate_cond_wait_end       BIGINT   gate_cond_wait stage end, epoch ns
--   gate_npu_sync_start      BIGINT   gate_npu_sync stage start, epoch ns
--   gate_npu_sync_end        BIGINT   gate_npu_sync stage end, epoch ns
--   meta_build_start         BIGINT   meta_build stage start, epoch ns
--   meta_build_end           BIGINT   meta_build stage end, epoch ns
--   h2d_stagger_start        BIGINT   h2d_stagger stage start, epoch ns
--   h2d_stagger_end          BIGINT   h2d_stagger stage end, epoch ns
--   slot_release_wait_start  BIGINT   slot_release_wait stage start, epoch ns
--   slot_release_wait_end    BIGINT   slot_release_wait stage end, epoch ns
--   backend_submit_start     BIGINT   backend_submit stage start, epoch ns
--   backend_submit_end       BIGINT   backend_submit stage end, epoch ns
--   completion_start         BIGINT   completion stage start, epoch ns
--   completion_end           BIGINT   completion stage end, epoch ns
--   consumer_wait_start      BIGINT   consumer_wait stage start, epoch ns
--   consumer_wait_end        BIGINT   consumer_wait stage end, epoch ns
--   ts_dep_save_cpu          BIGINT   save_cpu dependency met, epoch ns
--   ts_dep_save_cpu_lo       BIGINT   save_cpu: earliest bound, epoch ns
--   ts_dep_save_cpu_hi       BIGINT   save_cpu: latest bound, epoch ns
--   ts_dep_save_npu          BIGINT   save_npu dependency met, epoch ns
--   ts_dep_save_npu_lo       BIGINT   save_npu: earliest bound, epoch ns
--   ts_dep_save_npu_hi       BIGINT   save_npu: latest bound, epoch ns
--   ts_dep_gate_record       BIGINT   gate_record dependency met, epoch ns
--   ts_dep_gate_record_lo    BIGINT   gate_record: earliest bound, epoch ns
--   ts_dep_gate_record_hi    BIGINT   gate_record: latest bound, epoch ns
--   ts_dep_gate_npu          BIGINT   gate_npu dependency met, epoch ns
--   ts_dep_gate_npu_lo       BIGINT   gate_npu: earliest bound, epoch ns
--   ts_dep_gate_npu_hi       BIGINT   gate_npu: latest bound, epoch ns
--   ts_dep_slot_release      BIGINT   slot_release dependency met, epoch ns
--   ts_dep_slot_release_lo   BIGINT   slot_release: earliest bound, epoch ns
--   ts_dep_slot_release_hi   BIGINT   slot_release: latest bound, epoch ns
SELECT t.queue, t.seq, t.correlation_id, t.step,
       t.layer_id, t.final_layer, t.outcome, t.ready_precision,
       t.run_id, t.cfg_label, t.wait_for_save_layer, t.gate_id,
       t.cfg_num_shared_buffers, t.cfg_num_layers, t.cfg_independent_layers, t.trace_id,
       t.ts_enqueue, t.ts_dequeue, t.ts_ready, t.ts_ready_lo,
       t.ts_complete, t.queue_wait_start, t.queue_wait_end, t.save_cpu_wait_start,
       t.save_cpu_wait_end, t.save_npu_sync_start, t.save_npu_sync_end, t.gate_cond_wait_start,
       t.gate_cond_wait_end, t.gate_npu_sync_start, t.gate_npu_sync_end, t.meta_build_start,
       t.meta_build_end, t.h2d_stagger_start, t.h2d_stagger_end, t.slot_release_wait_start,
       t.slot_release_wait_end, t.backend_submit_start, t.backend_submit_end, t.completion_start,
       t.completion_end, t.consumer_wait_start, t.consumer_wait_end, t.ts_dep_save_cpu,
       t.ts_dep_save_cpu_lo, t.ts_dep_save_cpu_hi, t.ts_dep_save_npu, t.ts_dep_save_npu_lo,
       t.ts_dep_save_npu_hi, t.ts_dep_gate_record, t.ts_dep_gate_record_lo, t.ts_dep_gate_record_hi,
       t.ts_dep_gate_npu, t.ts_dep_gate_npu_lo, t.ts_dep_gate_npu_hi, t.ts_dep_slot_release,
       t.ts_dep_slot_release_lo, t.ts_dep_slot_release_hi
FROM tasks AS t JOIN timeline_windows AS w
  ON t.queue = w.queue AND t.seq >= w.lo AND t.seq < w.hi
ORDER BY t.queue, t.seq
