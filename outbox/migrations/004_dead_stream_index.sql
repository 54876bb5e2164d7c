-- verity outbox, migration 004: dead letters by stream, in id order.
--
-- A consumer that counts its stream's dead letters as lag (the leaderboard's
-- lag probe, run every LagProbeInterval) reads the stream's first dead
-- letter in id order. Without this index that read scans the whole
-- dead-letter table whenever the stream has none, which is the normal case.
-- Like every index here it is built only if missing (see 001): on an outbox
-- already migrated it takes no lock, and one built beforehand with CREATE
-- INDEX CONCURRENTLY under this name is kept as it is.
{{define "dead_stream"}}CREATE INDEX {{.DeadStreamIndex}}
    ON {{.Dead}} (stream, id){{end -}}
{{createIndex "dead_stream" .DeadStreamIndex}};
