-- verity outbox, migration 006: created_at must be a finite time.
--
-- created_at is an ordinary timestamptz, so a composed INSERT could store
-- 'infinity' or '-infinity', which Go's time.Time cannot hold. Relays of
-- earlier versions failed every claim that read such a row without
-- counting an attempt, so neither the row nor the other rows of the
-- partitions claimed with it were ever delivered. (Relays now hand such a
-- row out with a zero Record.CreatedAt.) This constraint refuses these
-- values for new rows; like 005's it is added once, NOT VALID, and only
-- when missing (see addCheckIfMissing).
--
-- A NOT VALID constraint still checks every UPDATE, and relays update a
-- pending row to retry it: pending rows already holding such a value are
-- therefore given the time of this migration. The UPDATE runs after the
-- constraint is in place, so it finds every such row, and later runs find
-- none; it reads them through the created_at partial index and locks
-- nothing that makes writers or relays wait. Rows kept published
-- (RelayConfig.KeepPublished) are never updated and keep their value.
-- Nor are pending rows whose stream is longer than 005 allows (appended
-- before 005): 005's constraint would refuse the update, and migration 007
-- moves them to the dead letters with their created_at as it is.
{{addCheck .Outbox "verity_outbox_created_at_finite" "isfinite(created_at)"}};

UPDATE {{.Outbox}} SET created_at = now()
WHERE published_at IS NULL AND created_at IN ('-infinity', 'infinity')
  AND octet_length(stream) <= {{.MaxStreamBytes}};
