-- verity outbox, migration 005: pending rows by stream and key.
--
-- A consumer that asks whether anything is pending for one key of its
-- stream (the leaderboard's lag probe, run every LagProbeInterval, asks it
-- for each dead letter whose user has a newer version) reads this index.
-- Without it the question reads every pending row of the stream, and
-- PostgreSQL can hash that set only while it fits in work_mem: past a few
-- hundred thousand pending rows, a backlog such as a Redis outage leaves,
-- each question re-reads them all. The index holds pending rows only, like
-- the others on the outbox, so acked rows kept for audit do not grow it.
-- Like every index here it is built only if missing (see 001): on an outbox
-- already migrated it takes no lock, and one built beforehand with CREATE
-- INDEX CONCURRENTLY under this name is kept as it is.
{{define "pending_key"}}CREATE INDEX {{.PendingKeyIndex}}
    ON {{.Outbox}} (stream, key)
    WHERE published_at IS NULL{{end -}}
{{createIndex "pending_key" .PendingKeyIndex}};
