-- verity outbox, migration 001: the outbox, its dead-letter table and the
-- command idempotency table. Every statement is idempotent, so running this
-- file again is harmless. Identifiers are rendered from the configured schema
-- and table names, each quoted with pgx.Identifier.
--
-- Indexes are created with createIndex (a DO block that runs CREATE INDEX
-- only when the index is missing), not CREATE INDEX IF NOT EXISTS: that takes
-- a SHARE lock on the table even when the index exists, so every Migrate of a
-- live outbox would stall its writers until the implicit transaction ends.
-- The schema and tables are likewise created with createSchema and
-- createTable (DO blocks that look them up first), not IF NOT EXISTS alone:
-- that checks the CREATE privilege on the database or schema before it
-- looks, so a role that only uses a migrated outbox could not run Migrate.

{{createSchema .Schema}};

-- One row per message awaiting delivery. A writer that composes its own
-- INSERT names only (event_id, stream, key, version, payload); every other
-- column has a default or is generated.
{{define "outbox"}}CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id     uuid        NOT NULL UNIQUE,
    stream       text        NOT NULL CHECK (stream <> ''),
    key          text        NOT NULL,
    version      bigint      NOT NULL CHECK (version > 0),
    payload      bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    attempts     integer     NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    leased_until timestamptz,
    claim_token  uuid,
    last_error   text,
    published_at timestamptz
) WITH (fillfactor = 50){{end -}}
{{createTable "outbox" .Outbox}};

-- available_at is when a row may next be attempted (insert time, or the end
-- of a retry backoff); leased_until is when the current claim ends. Claims
-- scan due rows in (available_at, id) order, so rows backing off are never
-- visited, and they change only unindexed columns (claim_token, leased_until,
-- attempts): with the free space fillfactor leaves, PostgreSQL can make the
-- claim a HOT update that writes no index entries.
{{define "pending"}}CREATE INDEX {{.PendingIndex}}
    ON {{.Outbox}} (available_at, id)
    WHERE published_at IS NULL{{end -}}
{{createIndex "pending" .PendingIndex}};

-- Backs the "oldest pending" figure of Stats in O(1), also when published rows
-- are kept for audit.
{{define "created"}}CREATE INDEX {{.CreatedIndex}}
    ON {{.Outbox}} (created_at)
    WHERE published_at IS NULL{{end -}}
{{createIndex "created" .CreatedIndex}};

-- Messages that failed MaxAttempts times, with the last error. id is the
-- original outbox id, kept so that a replay restores the row as it was.
-- event_id is not unique here: an event appended again after its first row
-- died may die too, and burying it must never fail (that would block the
-- relay's whole batch).
{{define "dead"}}CREATE TABLE IF NOT EXISTS {{.Dead}} (
    id         bigint      PRIMARY KEY,
    event_id   uuid        NOT NULL,
    stream     text        NOT NULL,
    key        text        NOT NULL,
    version    bigint      NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL,
    attempts   integer     NOT NULL,
    last_error text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
){{end -}}
{{createTable "dead" .Dead}};

{{define "dead_event"}}CREATE INDEX {{.DeadEventIndex}}
    ON {{.Dead}} (event_id){{end -}}
{{createIndex "dead_event" .DeadEventIndex}};

-- Commands already executed, keyed by their event id, with a fingerprint of
-- the command and, optionally, the result returned the first time.
{{define "idempotency"}}CREATE TABLE IF NOT EXISTS {{.Idempotency}} (
    event_id    uuid        PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    result      bytea,
    created_at  timestamptz NOT NULL DEFAULT now()
){{end -}}
{{createTable "idempotency" .Idempotency}};

-- Lets PruneCommands find expired idempotency records without a full scan.
{{define "idempotency_created"}}CREATE INDEX {{.IdempotencyCreatedIndex}}
    ON {{.Idempotency}} (created_at){{end -}}
{{createIndex "idempotency_created" .IdempotencyCreatedIndex}};
