-- verity outbox, migration 002: vacuum the outbox table like a queue.
--
-- Every acknowledged row is deleted, so the table churns through its whole
-- content while staying small. With PostgreSQL's default autovacuum trigger
-- (20% of the table dead) a large backlog accumulates hundreds of thousands
-- of dead rows whose entries stay in the (available_at, id) index until
-- vacuum removes them; every claim starts at the head of that index and walks
-- over them, so claims get slower as the backlog drains. A fixed threshold
-- and no cost delay let autovacuum keep up with the deletes. ALTER TABLE …
-- SET is idempotent and takes only a SHARE UPDATE EXCLUSIVE lock.
ALTER TABLE {{.Outbox}} SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
