-- verity outbox, migration 007: pending rows with an over-long stream go to
-- the dead letters.
--
-- Before 005, Append put no bound on the stream, so an upgraded outbox may
-- hold pending rows whose stream is longer than MaxStreamBytes ({{.MaxStreamBytes}}).
-- 005's constraint is NOT VALID, but it still checks every UPDATE: the
-- relay's retry of such a row, and the claim that counts the attempt of a
-- crashed batch, would fail, and with them the settle of the row's batch
-- and every claim of its partitions. Such a row cannot be delivered by
-- this version at all, so it is moved here to the dead-letter table, as a
-- relay buries a row (same id, attempts kept), with a last_error saying
-- why; it is never deleted. ReplayDead leaves such dead letters in place.
--
-- A stream too long even for the dead-letter table's (stream, id) index of
-- 004 (about 2.7 kB, after compression), or a row whose id the dead-letter
-- table already holds (possible only after the outbox's ids were reset),
-- cannot be moved: Migrate then fails, moving nothing, with a message that
-- counts them; shorten their stream (an UPDATE that does is allowed) or
-- copy them out and delete them, then migrate again.
--
-- Later runs find no such row (005 refuses them for new rows), but each
-- reads the pending rows once, O(pending), taking only the locks of a
-- DELETE that matches nothing. Rows kept published (KeepPublished) are
-- never updated and stay as they are. A relay that held such a row when
-- this ran finds it gone when it settles, as when its lease was lost.
{{define "bury_long_streams"}}DECLARE r record; unmovable bigint := 0; BEGIN
    FOR r IN DELETE FROM {{.Outbox}}
        WHERE published_at IS NULL AND octet_length(stream) > {{.MaxStreamBytes}}
        RETURNING id, event_id, stream, key, version, payload, created_at, attempts, last_error
    LOOP BEGIN
        INSERT INTO {{.Dead}} (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
        VALUES (r.id, r.event_id, r.stream, r.key, r.version, r.payload, r.created_at, r.attempts,
            'moved to the dead letters by migration 007: its stream is ' || octet_length(r.stream)
            || ' bytes, more than the {{.MaxStreamBytes}} (MaxStreamBytes) the outbox accepts since migration 005, so it could not be retried'
            || coalesce('; last error: ' || r.last_error, ''))
        ; EXCEPTION WHEN program_limit_exceeded OR unique_violation THEN unmovable := unmovable + 1; END; END LOOP
    ; IF unmovable > 0 THEN RAISE EXCEPTION USING
        MESSAGE = unmovable || ' pending outbox rows have a stream longer than {{.MaxStreamBytes}} bytes (MaxStreamBytes) and cannot be moved to the dead letters (the stream is too long for their (stream, id) index, or their id is there already)',
        HINT = 'shorten their stream (UPDATE ... SET stream = ... WHERE octet_length(stream) > {{.MaxStreamBytes}}), or copy them out and delete them, then migrate again'
    ; END IF; END{{end -}}
{{do "bury_long_streams"}};
