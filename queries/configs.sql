-- name: configs
-- implements: docs/analysis.md (report: the configuration legend)
-- requires: tasks
-- purpose: which configurations the traces hold: the legend the report numbers its rows by.
-- definition:
--   One row per configuration label and path, with its recv queues and tasks.
-- columns:
--   cfg_label  VARCHAR  configuration label
--   path       VARCHAR  gva or key
--   queues     BIGINT   recv FIFOs with that configuration
--   tasks      BIGINT   recv tasks
SELECT cfg_label, path, count(DISTINCT queue) AS queues, count(*) AS tasks
FROM tasks GROUP BY ALL ORDER BY cfg_label, path
