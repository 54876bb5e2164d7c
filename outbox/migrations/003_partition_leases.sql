-- verity outbox, migration 003: partition leases.
--
-- Relays no longer stamp every row they claim. Every outbox row belongs to
-- one of {{.Partitions}} partitions, mod(id / {{.Block}}, {{.Partitions}}): runs of {{.Block}}
-- consecutive ids take turns over the partitions. A relay leases
-- whole partitions in the small table below: one row write per partition per
-- batch instead of one per outbox row. While it holds a partition it reads
-- the partition's due rows with a plain SELECT and deletes them on
-- acknowledgement. The partition comes from the id, so it needs no new column
-- and no rewrite of an existing outbox; every statement is idempotent.
--
-- part          the partition, 0 to {{.Partitions}}-1
-- owner         the claim token of the batch holding it, NULL when free
-- leased_until  when that lease ends
-- touched_at    when it was last claimed: free partitions are taken least
--               recently claimed first, so relays take turns over all of them
-- inflight      the ids the holding batch was given: when a lease ends without
--               being released (the relay crashed or hung), the relay that
--               takes the partition over counts that attempt on these rows;
--               a multirange (PostgreSQL 14 or later) keeps runs of
--               consecutive ids small
{{define "leases"}}CREATE TABLE IF NOT EXISTS {{.Leases}} (
    part         bigint      PRIMARY KEY CHECK (part >= 0 AND part < {{.Partitions}}),
    owner        uuid,
    leased_until timestamptz,
    touched_at   timestamptz NOT NULL DEFAULT '-infinity',
    inflight     int8multirange NOT NULL DEFAULT '{}'
){{end -}}
{{createTable "leases" .Leases}};

-- Claims walk free partitions least recently claimed first and stop after
-- a few that have due rows; in this order they need not probe them all.
{{define "leases_touched"}}CREATE INDEX {{.LeasesTouchedIndex}}
    ON {{.Leases}} (touched_at, part){{end -}}
{{createIndex "leases_touched" .LeasesTouchedIndex}};

INSERT INTO {{.Leases}} (part)
SELECT generate_series(0, {{.Partitions}} - 1)
ON CONFLICT (part) DO NOTHING;

-- Every batch rewrites a few lease rows (and, for large batches, their
-- TOASTed inflight arrays): vacuum the table and its TOAST table like a queue.
-- Like 002's, these settings are applied only when they differ.
{{setOptions .Leases "autovacuum_vacuum_scale_factor=0" "autovacuum_vacuum_threshold=1000" "autovacuum_vacuum_cost_delay=0"
    "toast.autovacuum_vacuum_scale_factor=0" "toast.autovacuum_vacuum_threshold=1000" "toast.autovacuum_vacuum_cost_delay=0"}};

-- Claims no longer update outbox rows, so the free space that fillfactor 50
-- kept on every page for HOT claim updates only made each batch span twice
-- as many pages (measured: 20% more rows/s draining with full pages). The
-- setting applies to pages written from now on; existing pages keep theirs.
{{setOptions .Outbox "fillfactor=100"}};

-- A relay reads one partition's due rows oldest first: an equality on the
-- partition and a range on available_at, in index order, with no sort.
-- Like every index here it is built only if missing (see 001), so one built
-- beforehand with CREATE INDEX CONCURRENTLY under this name is kept as it is
-- and the outbox is not locked against writers.
{{define "partition"}}CREATE INDEX {{.PartitionIndex}}
    ON {{.Outbox}} (mod(id / {{.Block}}, {{.Partitions}}), available_at, id)
    WHERE published_at IS NULL{{end -}}
{{createIndex "partition" .PartitionIndex}};
