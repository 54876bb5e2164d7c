-- The seed design's tables, rebuilt as the benchmark's baseline: command
-- identity, current state and pending projection work, with a partial index
-- over unpublished outbox rows. Placeholders in double braces are replaced by
-- quoted, schema-qualified identifiers.

CREATE TABLE {{events}} (
    event_id   uuid        PRIMARY KEY,
    user_id    text        NOT NULL,
    delta      integer     NOT NULL CHECK (delta BETWEEN -1000 AND 1000),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {{scores}} (
    user_id    text        PRIMARY KEY,
    score      bigint      NOT NULL DEFAULT 0,
    version    bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {{outbox}} (
    id             bigserial   PRIMARY KEY,
    event_id       uuid        NOT NULL UNIQUE REFERENCES {{events}} (event_id),
    user_id        text        NOT NULL,
    absolute_score bigint      NOT NULL,
    score_version  bigint      NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);

CREATE INDEX {{pending_index}} ON {{outbox}} (id) WHERE published_at IS NULL;
