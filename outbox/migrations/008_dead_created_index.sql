-- verity outbox, migration 008: dead letters by stream, in creation order.
--
-- A consumer that counts its stream's dead letters as lag (the leaderboard's
-- lag probe) also looks for one dated after the database clock, which
-- happens only after that clock stepped back (then the lag cannot be
-- measured). With 004's (stream, id) index alone that look reads every dead
-- letter of the stream on every probe: measured 19-39 ms a probe with
-- 100,000 of them, after a long Redis outage buried a backlog. With this
-- index it is one short range scan of the rows dated after the reading,
-- normally none. Like every index here it is built only if missing (see
-- 001): building it reads the dead-letter table once, and while it runs
-- every relay's claims and settles wait (each statement may bury rows, so
-- it locks the dead-letter table for writing even when it buries none);
-- the outbox's writers do not, but for an upgrade from 005 or earlier,
-- where Migrate still holds 005's lock on the outbox (see the package
-- documentation) and they wait for the build too. That is normally a
-- moment, as the table is normally near empty; build it beforehand with
-- CREATE INDEX CONCURRENTLY under this name to avoid even that.
{{define "dead_created"}}CREATE INDEX {{.DeadCreatedIndex}}
    ON {{.Dead}} (stream, created_at){{end -}}
{{createIndex "dead_created" .DeadCreatedIndex}};
