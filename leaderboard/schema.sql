-- verity leaderboard schema. The double-brace placeholders are replaced by
-- quoted identifiers (tables schema-qualified) from the board's Config, the
-- index's qualified name as a string literal, and a dollar-quote tag found
-- nowhere else in the script.
-- Idempotent: every statement may run again.

SELECT pg_advisory_xact_lock(8317442061);

-- The schema and tables are created only when missing: CREATE SCHEMA and
-- CREATE TABLE IF NOT EXISTS alone check the CREATE privilege on the
-- database or schema before they look, so a role that only uses the board
-- could not run Migrate at start-up.
DO {{do}}
BEGIN
    IF to_regnamespace({{schema_literal}}) IS NULL THEN
        CREATE SCHEMA IF NOT EXISTS {{schema}}; END IF; END
{{do}};

-- One row per accepted command. The primary key on event_id is the
-- idempotency boundary; score and version record the command's result so a
-- duplicate can be answered with the original outcome.
DO {{do}}
BEGIN
    IF to_regclass({{score_events_regclass}}) IS NULL THEN
CREATE TABLE IF NOT EXISTS {{score_events}} (
    event_id   uuid        PRIMARY KEY,
    board      text        NOT NULL,
    user_id    text        COLLATE "C" NOT NULL,
    delta      bigint      NOT NULL,
    score      bigint      NOT NULL,
    version    bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Also checked per event, so a bulk import cannot pass through an
    -- out-of-range intermediate score.
    CONSTRAINT verity_score_events_score_range
        CHECK (score BETWEEN -9007199254740992 AND 9007199254740992)
); END IF; END
{{do}};

-- The authoritative score of every user on every board. user_id uses the C
-- collation so that ORDER BY user_id is byte order, the order Redis uses
-- for members with equal scores.
DO {{do}}
BEGIN
    IF to_regclass({{user_scores_regclass}}) IS NULL THEN
CREATE TABLE IF NOT EXISTS {{user_scores}} (
    board      text        NOT NULL,
    user_id    text        COLLATE "C" NOT NULL,
    score      bigint      NOT NULL,
    version    bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (board, user_id),
    CONSTRAINT verity_user_scores_score_range
        CHECK (score BETWEEN -9007199254740992 AND 9007199254740992),
    CONSTRAINT verity_user_scores_version_positive CHECK (version > 0)
); END IF; END
{{do}};

-- Ranking order: score descending, then user id ascending by bytes, written
-- as ascending (-score, user_id) so that keyset pages are one row
-- comparison and one index range scan. CREATE INDEX IF NOT EXISTS alone
-- would take a SHARE lock on user_scores even when the index exists, held
-- until this script's transaction ends: every Submit would wait for a
-- Migrate at start-up, and Migrate for every open SubmitTx. So it runs
-- only when the index is missing (the advisory lock above makes the check
-- and the creation atomic). An index of that name left invalid by a
-- CREATE INDEX CONCURRENTLY that failed fails the migration, as the
-- outbox's do: the planner cannot use it. No line inside the block ends with a
-- semicolon: tools that split scripts at such lines (goose) keep it whole.
DO {{do}}
BEGIN
    IF to_regclass({{rank_index_regclass}}) IS NULL THEN
        CREATE INDEX {{rank_index}}
            ON {{user_scores}} (board, (-score), user_id); ELSIF NOT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass({{rank_index_regclass}})) THEN
        RAISE EXCEPTION 'index % exists but is invalid (a CREATE INDEX CONCURRENTLY that failed or is still running): drop it, or let its build finish, then migrate again', {{rank_index_regclass}}; END IF; END
{{do}};
