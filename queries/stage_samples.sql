-- name: stage_samples
-- implements: docs/analysis.md (the report's per-configuration stage CDFs)
-- requires: tasks
-- purpose: per configuration and stage, a deterministic sample of stage durations for the CDF plots.
-- definition:
--   One value per task and stage (tasks.<stage>_ns, skipped when NULL). Per configuration and stage, the
--   first stage_sample tasks ordered by hash(correlation_id), then seq, so the sample is the same on
--   every run. Rows come in pipeline order of the stages.
-- parameters:
--   stage_sample  BIGINT  values kept per configuration and stage (default 20000), SET VARIABLE stage_sample
-- columns:
--   cfg_label  VARCHAR  configuration label ('(no label)' when none)
--   stage      VARCHAR  child span name
--   dur_ns     BIGINT   the stage's duration in one task, ns
SELECT coalesce(label, '(no label)') AS cfg_label, stage, dur_ns FROM (
    SELECT cfg_label AS label, correlation_id, seq, queue_wait_ns, save_cpu_wait_ns, save_npu_sync_ns,
           gate_cond_wait_ns, gate_npu_sync_ns, meta_build_ns, h2d_stagger_ns, slot_release_wait_ns,
           backend_submit_ns, completion_ns, consumer_wait_ns
    FROM tasks
) UNPIVOT (dur_ns FOR stage IN (
        queue_wait_ns AS 'queue_wait', save_cpu_wait_ns AS 'save_cpu_wait', save_npu_sync_ns AS 'save_npu_sync',
        gate_cond_wait_ns AS 'gate_cond_wait', gate_npu_sync_ns AS 'gate_npu_sync', meta_build_ns AS 'meta_build',
        h2d_stagger_ns AS 'h2d_stagger', slot_release_wait_ns AS 'slot_release_wait', backend_submit_ns AS 'backend_submit',
        completion_ns AS 'completion', consumer_wait_ns AS 'consumer_wait'))
QUALIFY row_number() OVER (PARTITION BY label, stage ORDER BY hash(correlation_id), seq)
        <= coalesce(getvariable('stage_sample'), 20000)
ORDER BY list_position(['queue_wait', 'save_cpu_wait', 'save_npu_sync', 'gate_cond_wait', 'gate_npu_sync', 'meta_build',
                      'h2d_stagger', 'slot_release_wait', 'backend_submit', 'completion', 'consumer_wait'], stage), cfg_label,
         hash(correlation_id), seq
