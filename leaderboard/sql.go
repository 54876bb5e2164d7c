package leaderboard

import (
	"strconv"
	"strings"
)

// All SQL of the package. Placeholders in double braces are replaced once,
// in New, by quoted identifiers; values are always bind parameters.

// submitCTEs applies one command; submitSQL and submitTxSQL finish it.
//
//	$1 event id, $2 board, $3 user id, $4 delta, $5 stream
//
// prior finds an earlier use of the event id. If there is none, upserted
// changes the score, recorded keeps the command and its result and queued
// appends the absolute score to the outbox. The statement returns the new
// result, or the prior row when the event id was already used (Go compares
// it with the command).
//
// A twin committed after this statement's snapshot is invisible to prior;
// then the INSERT into score_events waits for it and fails with a unique
// violation, which aborts the whole statement. Submit answers that case
// with a follow-up read (lookupEventSQL). queued reads from recorded, so the
// score_events insert always runs first: a unique violation on the outbox
// table therefore means another outbox writer holds the event id, never a
// twin (SubmitTx, which cannot run a follow-up read in an aborted
// transaction, relies on that to tell the two apart).
const submitCTEs = `
WITH prior AS (
    SELECT board, user_id, delta, score, version
    FROM {{score_events}}
    WHERE event_id = $1::uuid
),
upserted AS (
    INSERT INTO {{user_scores}} AS s (board, user_id, score, version)
    SELECT $2::text, $3::text, $4::bigint, 1
    WHERE NOT EXISTS (SELECT 1 FROM prior)
    ON CONFLICT (board, user_id) DO UPDATE
    SET score = s.score + EXCLUDED.score,
        -- NULL, refused by NOT NULL, rather than bigint's overflow
        -- (22003), which reads as a score out of range.
        version = CASE WHEN s.version < 9223372036854775807 THEN s.version + 1 END,
        updated_at = now()
    RETURNING score, version
),
recorded AS (
    INSERT INTO {{score_events}} (event_id, board, user_id, delta, score, version)
    SELECT $1::uuid, $2::text, $3::text, $4::bigint, score, version
    FROM upserted
    RETURNING score, version
),
queued AS (
    INSERT INTO {{outbox}} (event_id, stream, key, version, payload)
    SELECT $1::uuid, $5::text, $3::text, version, convert_to(score::text, 'UTF8')
    FROM recorded
)`

// submitSQL is Submit's statement, run in autocommit so that it is its own
// transaction (one round trip). It does not notify: a pg_notify inside it
// would serialise the commits of concurrent submits (PostgreSQL holds a
// database-wide lock from PreCommit_Notify through the WAL flush), so
// Submit wakes the relays through the board's outbox.Notifier after the
// statement returned.
const submitSQL = submitCTEs + `
SELECT false, u.score, u.version, $2::text, $3::text, $4::bigint
FROM upserted AS u
UNION ALL
SELECT true, score, version, board, user_id, delta
FROM prior`

// submitTxSQL is SubmitTx's statement: submitSQL plus notified, which
// wakes the relays of stream $5 on channel $6 when the caller's transaction
// commits (and never if it rolls back). The notification stays inside because the
// board cannot know when, or whether, the caller commits.
const submitTxSQL = submitCTEs + `,
notified AS (
    SELECT pg_notify($6::text, $5::text) FROM upserted
)
SELECT false, u.score, u.version, $2::text, $3::text, $4::bigint
FROM upserted AS u, (SELECT count(*) FROM notified) AS n
UNION ALL
SELECT true, score, version, board, user_id, delta
FROM prior`

// lookupEventSQL reads the recorded result of an event id.
const lookupEventSQL = `
SELECT board, user_id, delta, score, version
FROM {{score_events}}
WHERE event_id = $1::uuid`

// submitBatchCTEs applies many commands in one statement; submitBatchSQL
// and submitBatchTxSQL finish it.
//
//	$1 event ids, $2 user ids, $3 deltas (parallel arrays, no repeated id),
//	$4 board, $5 stream, $6 every state
//
// When any event id was already used for a different command, conflicted
// is non-empty and nothing is written; the prior rows are returned and Go
// reports the conflict. Otherwise every new command is applied: each user's
// row is upserted once (ON CONFLICT cannot touch a row twice), in user id
// order so that concurrent batches lock rows in the same order, and each
// command's own score and version are derived from running sums in batch
// order. Unless $6 (Submit's groups, which keep Submit's one outbox row per
// command), only each user's last state goes to the outbox: payloads are
// absolute, so the intermediate ones would be superseded anyway.
//
// The row upserted proposes each user's batch total as its score, and
// PostgreSQL checks the score's CHECK on that proposed row even when it
// then updates an existing one: a total outside [MinScore, MaxScore] is
// proposed clamped, and an existing row adds the exact total (looked up in
// totals only then). A user inserted with a clamped total (version = n)
// has its commands' scores counted from 0, so its last one fails
// score_events' CHECK as it should.
//
// Event ids are recorded in id order, so that two batches (or a batch and
// a caller's transaction) that collide on several ids wait for them in the
// same order, and the outbox rows are read from recorded: a twin's id
// always violates score_events' key before the outbox's, so a unique
// violation on the outbox means another outbox writer holds the id, as in
// submitSQL.
//
// prior probes score_events' primary key once per id, through a lateral
// subquery that OFFSET 0 keeps from being flattened into a join. Written
// as event_id = ANY ($1), the planner chose by the table's statistics, and
// without fresh ones (a bulk import into a new table, autovacuum behind or
// off) it read the whole event history for every batch: at 250,000 events
// that read took 50-75 ms per 1,000 ids against 4 ms for the probes, and it
// grows with the table. TestManyKeyPlans checks the plans.
//
// conflicted aggregates the whole join rather than stopping at a LIMIT 1:
// with a LIMIT, PostgreSQL expects an early match and joins prior and input
// by a nested loop, which compares every pair of ids when no command
// conflicts (a retry of a committed batch: 64M pairs, 3-8 s, for 8,000).
const submitBatchCTEs = `
WITH input AS (
    SELECT i.ord, i.event_id, i.user_id COLLATE "C" AS user_id, i.delta
    FROM unnest($1::uuid[], $2::text[], $3::bigint[]) WITH ORDINALITY AS i(event_id, user_id, delta, ord)
),
prior AS (
    SELECT e.event_id, e.board, e.user_id, e.delta, e.score, e.version
    FROM unnest($1::uuid[]) AS k(event_id)
    CROSS JOIN LATERAL (
        SELECT s.event_id, s.board, s.user_id, s.delta, s.score, s.version
        FROM {{score_events}} AS s
        WHERE s.event_id = k.event_id
        OFFSET 0
    ) AS e
),
conflicted AS (
    SELECT 1
    FROM (
        SELECT bool_or(p.board <> $4::text OR p.user_id <> i.user_id OR p.delta <> i.delta) AS differs
        FROM prior AS p JOIN input AS i USING (event_id)
    ) AS c
    WHERE c.differs
),
fresh AS (
    SELECT i.ord, i.event_id, i.user_id, i.delta,
           sum(i.delta) OVER w AS running, row_number() OVER w AS seq
    FROM input AS i
    WHERE NOT EXISTS (SELECT 1 FROM conflicted)
      AND NOT EXISTS (SELECT 1 FROM prior AS p WHERE p.event_id = i.event_id)
    WINDOW w AS (PARTITION BY i.user_id ORDER BY i.ord)
),
totals AS (
    SELECT user_id, sum(delta) AS total, count(*) AS n
    FROM fresh
    GROUP BY user_id
),
upserted AS (
    INSERT INTO {{user_scores}} AS s (board, user_id, score, version)
    SELECT $4::text, user_id, LEAST(GREATEST(total, -9007199254740992), 9007199254740992), n
    FROM totals
    ORDER BY user_id
    ON CONFLICT (board, user_id) DO UPDATE
    SET score = s.score + CASE
            WHEN abs(EXCLUDED.score) < 9007199254740992 THEN EXCLUDED.score
            ELSE (SELECT t.total FROM totals AS t WHERE t.user_id = EXCLUDED.user_id)
        END,
        version = CASE WHEN s.version <= 9223372036854775807 - EXCLUDED.version THEN s.version + EXCLUDED.version END,
        updated_at = now()
    RETURNING user_id, score, version
),
results AS (
    SELECT f.ord, f.event_id, f.user_id, f.delta,
           CASE WHEN u.version = t.n THEN 0 ELSE u.score - t.total END + f.running AS score,
           u.version - t.n + f.seq AS version,
           f.seq = t.n AS last
    FROM fresh AS f
    JOIN totals AS t USING (user_id)
    JOIN upserted AS u USING (user_id)
),
recorded AS (
    INSERT INTO {{score_events}} (event_id, board, user_id, delta, score, version)
    SELECT event_id, $4::text, user_id, delta, score, version
    FROM results
    ORDER BY event_id
    RETURNING event_id
),
queued AS (
    INSERT INTO {{outbox}} (event_id, stream, key, version, payload)
    SELECT r.event_id, $5::text, r.user_id, r.version, convert_to(r.score::text, 'UTF8')
    FROM results AS r JOIN recorded USING (event_id)
    WHERE r.last OR $6::boolean
)`

// submitBatchSQL is SubmitBatch's statement (and that of Submit's groups):
// one row per command, new or prior. Like submitSQL it does not notify;
// SubmitBatch uses the board's Notifier.
const submitBatchSQL = submitBatchCTEs + `
SELECT r.ord, false, r.score, r.version, $4::text, r.user_id::text, r.delta
FROM results AS r
UNION ALL
SELECT i.ord, true, p.score, p.version, p.board, p.user_id::text, p.delta
FROM prior AS p JOIN input AS i USING (event_id)`

// submitBatchTxSQL is SubmitBatchTx's statement: submitBatchSQL's rows as
// one JSON array in one row, because outbox.Tx reads single rows only
// (database/sql's transactions too, through outbox.SQLTx), plus notified,
// which wakes the relays on channel $7 when the caller's transaction
// commits, once however many commands it applied (see submitTxSQL). Each
// element is an object: o the command's position (1-based), d duplicate,
// s score, v version, b board, u user id, x delta. JSON carries bigint
// exactly (its digits), and scores are within +-2^53 anyway.
const submitBatchTxSQL = submitBatchCTEs + `,
notified AS (
    SELECT pg_notify($7::text, $5::text)
    WHERE EXISTS (SELECT 1 FROM recorded)
),
answered AS (
    SELECT r.ord, false AS duplicate, r.score, r.version, $4::text AS board, r.user_id::text AS user_id, r.delta
    FROM results AS r
    UNION ALL
    SELECT i.ord, true, p.score, p.version, p.board, p.user_id::text, p.delta
    FROM prior AS p JOIN input AS i USING (event_id)
)
SELECT coalesce(json_agg(json_build_object(
    'o', a.ord, 'd', a.duplicate, 's', a.score, 'v', a.version, 'b', a.board, 'u', a.user_id, 'x', a.delta)), '[]')::text
FROM answered AS a, (SELECT count(*) FROM notified) AS n`

// setLockTimeoutSQL sets lock_timeout ($1, for example "50ms") for the rest
// of the current transaction.
const setLockTimeoutSQL = `SELECT set_config('lock_timeout', $1::text, true)`

// setLockTimeoutCustomPlanSQL is setLockTimeoutSQL for a shared statement
// of more than preparedBatchMax commands: it also makes PostgreSQL plan the
// statement that follows in the same transaction for its actual arrays,
// not with the cached generic plan (see sendBatch), and without JIT (see
// customPlanSQL).
const setLockTimeoutCustomPlanSQL = `SELECT set_config('lock_timeout', $1::text, true), set_config('plan_cache_mode', 'force_custom_plan', true), set_config('jit', 'off', true)`

// customPlanSQL makes PostgreSQL plan the statement that follows in the
// same transaction for its actual arrays, whatever plan_cache_mode the
// session has (see sendBatch). It also turns JIT off for that transaction:
// from about 10,000 commands the statement's estimated cost passes the
// default jit_above_cost, and compiling it took 62-226 ms a batch, for no
// gain in its execution.
const customPlanSQL = `SELECT set_config('plan_cache_mode', 'force_custom_plan', true), set_config('jit', 'off', true)`

// forceCustomPlanSQL makes PostgreSQL plan the statements that follow in
// the current transaction for their arguments, without JIT (see
// customPlanSQL), and returns the settings it replaced (read first: the
// CTE is materialized), for restorePlanModeSQL.
const forceCustomPlanSQL = `
WITH prev AS MATERIALIZED (SELECT current_setting('plan_cache_mode') AS v, current_setting('jit') AS j)
SELECT v, j, set_config('plan_cache_mode', 'force_custom_plan', true), set_config('jit', 'off', true) FROM prev`

// restorePlanModeSQL puts plan_cache_mode ($1) and jit ($2) back for the
// rest of the current transaction.
const restorePlanModeSQL = `SELECT set_config('plan_cache_mode', $1::text, true), set_config('jit', $2::text, true)`

// overflowProbeSQL reads, for a refused batch, the current scores of its
// users ($2) and which of its event ids ($3) were applied before: board $1.
// Both parts probe a primary key once per distinct element, as
// submitBatchSQL's prior does.
const overflowProbeSQL = `
SELECT s.user_id::text, s.score, false
FROM (SELECT DISTINCT unnest($2::text[]) COLLATE "C") AS k(user_id)
CROSS JOIN LATERAL (
    SELECT u.user_id, u.score
    FROM {{user_scores}} AS u
    WHERE u.board = $1::text AND u.user_id = k.user_id
    OFFSET 0
) AS s
UNION ALL
SELECT e.event_id::text, 0, true
FROM (SELECT DISTINCT unnest($3::uuid[])) AS k(event_id)
CROSS JOIN LATERAL (
    SELECT s.event_id
    FROM {{score_events}} AS s
    WHERE s.event_id = k.event_id
    OFFSET 0
) AS e`

// Reads. The ranking order is (-score, user_id) ascending, user_id in the C
// collation: score descending, ties by user id bytes ascending. rankIndex
// serves every one of these as an index range scan.
//
// Their LIMITs are subqueries, so that a custom plan does not see the page
// size: on a table never analysed (a bulk import, autovacuum behind or
// off) the planner expects a few hundred to a few thousand rows of a board
// (654 of 200,000 users), and a page of 1,000 was planned as a bitmap scan
// of every row after the cursor and a sort (100,000-500,000 rows, 0.03-0.6
// s) instead of the index walk. A hidden limit is costed at a tenth of the
// rows, as in a generic plan. The source's pages (reconciler.go) do the
// same; TestKeysetPagesReadOnePageWithoutStatistics checks the plans.

// topSQL returns the first $2 entries of board $1 with their ranks.
const topSQL = `
SELECT user_id::text, score, row_number() OVER (ORDER BY -score, user_id)
FROM (
    SELECT user_id, score
    FROM {{user_scores}}
    WHERE board = $1::text
    ORDER BY -score, user_id
    LIMIT (SELECT $2::bigint)
) AS page
ORDER BY -score, user_id`

// pageSQL returns up to $2 entries of board $1 after the cursor (score $3,
// user $4) with their ranks. The rank base is counted in the same
// statement, so ranks and rows share one snapshot. (The first page has its
// own statement: an optional cursor written as "NOT $x OR ..." would keep a
// cached generic plan from using the row comparison as an index bound.)
const pageSQL = `
SELECT user_id::text, score,
       (
           SELECT count(*)
           FROM {{user_scores}}
           WHERE board = $1::text
             AND (-score, user_id) <= (-$3::bigint, $4::text COLLATE "C")
       ) + row_number() OVER (ORDER BY -score, user_id)
FROM (
    SELECT user_id, score
    FROM {{user_scores}}
    WHERE board = $1::text
      AND (-score, user_id) > (-$3::bigint, $4::text COLLATE "C")
    ORDER BY -score, user_id
    LIMIT (SELECT $2::bigint)
) AS page
ORDER BY -score, user_id`

// pageBytesSQL is pageSQL for a cursor whose user ($4, bytea) PostgreSQL
// cannot take as text: a sorted-set member that is no user id (invalid
// UTF-8 or a NUL byte, a foreign writer's) ended the page. user_id's bytes
// are compared with it instead, in the same byte order (the database's
// encoding is UTF-8, as Redis's order of the same ids requires). The index
// bounds the score only: the entries tied with the cursor's score are
// filtered one by one, which only such cursors pay.
const pageBytesSQL = `
SELECT user_id::text, score,
       (
           SELECT count(*)
           FROM {{user_scores}}
           WHERE board = $1::text
             AND -score <= -$3::bigint
             AND (-score < -$3::bigint OR convert_to(user_id, 'UTF8') <= $4::bytea)
       ) + row_number() OVER (ORDER BY -score, user_id)
FROM (
    SELECT user_id, score
    FROM {{user_scores}}
    WHERE board = $1::text
      AND -score >= -$3::bigint
      AND (-score > -$3::bigint OR convert_to(user_id, 'UTF8') > $4::bytea)
    ORDER BY -score, user_id
    LIMIT (SELECT $2::bigint)
) AS page
ORDER BY -score, user_id`

// rankSQL returns the score and rank of user $2 on board $1. Counting
// the entries ahead reads O(rank) rows; it is the fallback path.
const rankSQL = `
SELECT me.score, 1 + ahead.n
FROM {{user_scores}} AS me
CROSS JOIN LATERAL (
    SELECT count(*) AS n
    FROM {{user_scores}} AS s
    WHERE s.board = me.board
      AND (-s.score, s.user_id) < (-me.score, me.user_id)
) AS ahead
WHERE me.board = $1::text AND me.user_id = $2::text`

// aroundSQL returns user $2 of board $1 with up to $3 neighbours on each
// side, ranks included, in ranking order; no rows when the user is absent.
// LATERAL makes the user's (score, user_id) an index bound of each scan.
const aroundSQL = `
WITH me AS (
    SELECT board, score, user_id
    FROM {{user_scores}}
    WHERE board = $1::text AND user_id = $2::text
),
before AS (
    SELECT b.user_id, b.score
    FROM me CROSS JOIN LATERAL (
        SELECT s.user_id, s.score
        FROM {{user_scores}} AS s
        WHERE s.board = me.board
          AND (-s.score, s.user_id) < (-me.score, me.user_id)
        ORDER BY -s.score DESC, s.user_id DESC
        LIMIT (SELECT $3::bigint)
    ) AS b
),
after AS (
    SELECT a.user_id, a.score
    FROM me CROSS JOIN LATERAL (
        SELECT s.user_id, s.score
        FROM {{user_scores}} AS s
        WHERE s.board = me.board
          AND (-s.score, s.user_id) >= (-me.score, me.user_id)
        ORDER BY -s.score, s.user_id
        LIMIT (SELECT $3::bigint + 1)
    ) AS a
),
base AS (
    SELECT ahead.n
    FROM me CROSS JOIN LATERAL (
        SELECT count(*) AS n
        FROM {{user_scores}} AS s
        WHERE s.board = me.board
          AND (-s.score, s.user_id) < (-me.score, me.user_id)
    ) AS ahead
)
SELECT w.user_id::text, w.score,
       base.n - (SELECT count(*) FROM before) + row_number() OVER (ORDER BY -w.score, w.user_id)
FROM (SELECT * FROM before UNION ALL SELECT * FROM after) AS w, base
ORDER BY -w.score, w.user_id`

// atLeastSQL is the template of a read statement's variant for an answer
// from PostgreSQL to a read with AtLeast requirements (withAtLeast fills
// it in):
//
//	{{read}} the read statement, whose columns are {{columns}}, with its
//	own parameters ($1 the board); {{users}} and {{versions}} the
//	requirements (parallel arrays, one element per user)
//
// met.ok is true when each user's version in user_scores has reached its
// requirement (a user without a row has none): read in the same statement
// as the answer, so in the same snapshot, and a version the answer does
// not reflect (its transaction rolled back or has not committed) is never
// reported met. Each requirement probes the primary key once, through a
// scalar subquery (at most MaxAtLeast of them). The read is joined to the
// one row of met with LEFT JOIN, so that an empty answer (the end of the
// board, a user without a score) still has its row, with NULL columns;
// ORDER BY rank restores the ranking order, along which the ranks of every
// read increase.
const atLeastSQL = `
SELECT {{a.columns}}, met.ok
FROM (
    SELECT COALESCE(bool_and(COALESCE((
               SELECT u.version
               FROM {{user_scores}} AS u
               WHERE u.board = $1::text AND u.user_id = k.user_id COLLATE "C"
           ), 0) >= k.version), true)
    FROM unnest({{users}}::text[], {{versions}}::bigint[]) AS k(user_id, version)
) AS met(ok)
LEFT JOIN ({{read}}) AS a({{columns}}) ON true
ORDER BY a.rank`

// withAtLeast returns the atLeastSQL variant of read statement q, whose
// columns are columns (the last named rank) and whose parameters are $1 to
// $params; the requirements follow as $params+1 and $params+2.
func withAtLeast(q string, columns []string, params int) string {
	qualified := make([]string, len(columns))
	for i, c := range columns {
		qualified[i] = "a." + c
	}
	return strings.NewReplacer(
		"{{a.columns}}", strings.Join(qualified, ", "),
		"{{columns}}", strings.Join(columns, ", "),
		"{{users}}", "$"+strconv.Itoa(params+1),
		"{{versions}}", "$"+strconv.Itoa(params+2),
		"{{read}}", strings.TrimSpace(q),
	).Replace(atLeastSQL)
}

// lagSQL reads the database clock, the creation time of the board's
// oldest unprojected change, whose age it measures, and that of an
// unprojected change dated after the clock, which makes the age
// unmeasurable: $1 stream, $2 board.
// Unprojected means pending in the outbox, or dead-lettered: a row that
// failed MaxAttempts times left the outbox for its dead-letter table, and
// Redis may lack it for good, so it counts as waiting since its original
// creation until it is replayed (outbox.Relay.ReplayDead) or deleted. An
// age rather than "unknown" (a negative Lag, which means PostgreSQL could
// not be asked, or its clock made the age unmeasurable: see the third
// column) keeps Lag's meaning: the age of the oldest change Redis may not
// reflect; it exceeds MaxLag once the dead letter is MaxLag old.
//
// A dead letter stops counting once a newer version of its user (the row's
// key) has reached Redis: payloads are absolute, so Redis then holds newer
// state and the dead letter no longer matters. Otherwise one dead letter
// would keep Lag above MaxLag for good, and FailClosed and FallbackToPostgres
// boards would refuse or divert every read although Redis is right. The
// user's current version (user_scores) has reached Redis when it is newer
// than the dead letter, none of the user's rows is pending in the outbox
// (the first subquery would count only the pending row's own, younger age)
// and the current version is not dead-lettered itself (then Redis has
// neither, and the older dead letter keeps counting). Dead letters between
// the two do not matter: the current version's payload replaces them. A
// dead letter of the current version never stops counting this way.
//
// counted holds the stream's dead letters that count (not superseded).
// The outbox's partial index on created_at makes the first subquery a short
// index scan (it skips pending rows of other streams that are older). The
// second reads counted in creation order: the stream's dead letters by the
// dead-letter table's (stream, created_at) index (outbox migration 008),
// stopping at the first one not superseded; each check is a primary-key lookup in user_scores, and only
// a dead letter whose user has a newer version goes on to the pending and
// dead checks.
// Those are uncorrelated NOT IN subqueries on equalities, which PostgreSQL
// runs as hashed subplans: each reads its set once per probe, and only when
// some dead letter gets that far (a test for any newer dead letter, an
// inequality, could not be hashed and would rescan the stream's dead
// letters for each). No outbox index covers (stream, key): the pending
// set is read by a partial index on published_at IS NULL and filtered by
// stream, which is cheap because pending rows are few unless the relays
// are behind (and then that backlog is the lag anyway). Known limit: past
// roughly 250,000 pending rows of the stream (default work_mem) PostgreSQL
// stops hashing the pending set and reads it once per superseded dead
// letter — seconds per probe with hundreds of them. A partial (stream, key)
// index would serve that check, but measured 0.8x SubmitBatch throughput
// (18,300-19,600 vs 22,900-24,300 commands/s), too much to pay on every
// write for a probe in a double failure. The dead-letter table is normally empty
// (every row is an alert); a superseded dead letter costs one lookup per
// probe until it is deleted. Creation order, not id order: an id is
// drawn when its row is inserted and created_at is its transaction's
// start, so a row written late in a long transaction has a newer id than
// rows written meanwhile, and id order would take their age for its own.
//
// The dead-letter scans bound the stream by two inequalities, not one
// equality, and read counted in (stream, created_at) order, which is
// creation order within the one stream: only the index of those columns
// returns rows in that order. Given stream = $1 and ORDER BY created_at,
// the planner may instead
// walk the primary key and filter on stream, and a generic plan (pgx caches
// the statement; PostgreSQL plans it generically from its sixth run) cannot
// see $1: it takes that walk when the statistics say one stream holds most
// dead letters, and then reads the whole table whenever this stream has
// none, the normal case. The column has the database's default collation,
// which is deterministic, so the inequalities select exactly the equal
// strings. TestLagProbePlan checks the generic plan.
//
// LEAST and GREATEST ignore NULLs: the result is NULL only when neither
// has a row.
//
// The third column is the creation time of an unprojected row dated after
// the clock reading, NULL when none is: the later of the stream's latest
// pending row dated after it and the earliest of its counted dead letters
// dated after it. A committed row is visible only if it committed before
// the statement's snapshot, so its created_at (its transaction's start; a
// dead letter keeps its row's) can follow this reading only when the
// database clock stepped back since it was written (an NTP step, a VM resumed, a
// failover to a host whose clock lags), or when a writer stamped
// created_at itself from a clock ahead. Such a row's age, and that of any
// older row stamped before the step, cannot be measured: the minimum of
// LEAST may be a row stamped after the step, pending or dead, and a row
// from the future would count as waiting for no time at all. The board
// reports the lag as unmeasured (Lag -1) instead, and logs how far ahead
// the row is (the clock stepped back at least that far). Every counted
// dead letter is checked, not only the one LEAST sees: a newer pending row
// or an older dead letter dated before the clock would hide it there.
// Superseded dead letters are not: Redis holds newer state for them, and
// one dated after the clock would keep the board at Lag -1 until the clock
// passes it, up to the whole step, while nothing is missing.
//
// The clock is read once, in c (PostgreSQL does not pull up a subquery
// whose output calls a volatile function), so that the columns compare
// with one reading, and the looks can use that reading as a bound of an
// index (a volatile call in their WHERE could not be): the pending look one
// short range scan of the created_at index, the dead-letter look one of the
// dead-letter table's (stream, created_at) index (outbox migration 008),
// each over the rows after the reading, normally none; the superseded check
// runs only for those. Without that index (an outbox not yet migrated) the
// probe still answers the same, but reads every dead letter of the stream
// (by the (stream, id) index, or a scan of the dead-letter table when the
// stream holds most of them) in each of its two looks: one such look took
// about 12 ms with 100,000 of them, against 0.1 ms with the index. counted is NOT MATERIALIZED so that each
// use is planned in place with its own filter and LIMIT (materialized, it
// would run the superseded check on every dead letter of the stream). Both
// read it in the (stream, created_at) index's order, so that a generic
// plan keeps to that index.
// TestLagProbePlan checks these plans too.
const lagSQL = `
WITH counted AS NOT MATERIALIZED (
    SELECT d.stream, d.created_at
    FROM {{outbox_dead}} AS d
    WHERE d.stream >= $1::text AND d.stream <= $1::text
      AND NOT EXISTS (
          SELECT 1
          FROM {{user_scores}} AS s
          WHERE s.board = $2::text
            AND s.user_id = d.key COLLATE "C"
            AND s.version > d.version
            AND d.key NOT IN (
                SELECT o.key
                FROM {{outbox}} AS o
                WHERE o.published_at IS NULL AND o.stream = $1::text
            )
            AND (d.key, s.version) NOT IN (
                SELECT n.key, n.version
                FROM {{outbox_dead}} AS n
                WHERE n.stream >= $1::text AND n.stream <= $1::text
            )
      )
)
SELECT c.now, LEAST(
    (
        SELECT created_at
        FROM {{outbox}}
        WHERE published_at IS NULL AND stream = $1::text
        ORDER BY created_at
        LIMIT 1
    ),
    (
        SELECT created_at
        FROM counted
        ORDER BY stream, created_at
        LIMIT 1
    )
), GREATEST(
    (
        SELECT f.created_at
        FROM {{outbox}} AS f
        WHERE f.published_at IS NULL AND f.created_at > c.now AND f.stream = $1::text
        ORDER BY f.created_at DESC
        LIMIT 1
    ),
    (
        SELECT created_at
        FROM counted
        WHERE created_at > c.now
        ORDER BY stream, created_at
        LIMIT 1
    )
)
FROM (SELECT clock_timestamp() AS now) AS c`

// sourceIdentitySQL reads the database's identity, which Verify records
// with its result and reads compare (Config.RequireVerifiedProjection; see
// sameSource): "<system identifier>:<timeline>" on a primary, where a
// restore into a new cluster changes the system identifier, and a promoted
// standby or a point-in-time recovery starts a new timeline, at once
// (unlike pg_control_checkpoint's, which waits for the next checkpoint).
// A standby has no current WAL position; its identity is "<system
// identifier>:~<timeline>", the latest timeline its control file names
// (its last restartpoint, or the minimum recovery point), a lower bound
// of the one it replays: a standby that follows a promoted one reaches
// the new timeline there at its next restartpoint, or sooner. Timelines
// are eight hexadecimal digits, as in WAL file names. The control-file
// functions run on a standby only, but PostgreSQL checks the privilege to
// run every function here on any server; all are executable by any role
// by default.
const sourceIdentitySQL = `SELECT s.system_identifier::text || ':' || CASE
    WHEN pg_is_in_recovery() THEN '~' || lpad(upper(to_hex(GREATEST(
        (SELECT c.timeline_id FROM pg_control_checkpoint() AS c),
        (SELECT r.min_recovery_end_timeline FROM pg_control_recovery() AS r)
    ))), 8, '0')
    ELSE substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)
END
FROM pg_control_system() AS s`

// renderSQL replaces the identifier placeholders of q. outboxTable is the
// outbox table's unquoted name; outbox.Config documents the dead-letter
// table's name as that name + "_dead".
func renderSQL(q string, schema, outboxTable string) string {
	return strings.NewReplacer(
		"{{score_events}}", qualify(schema, ScoreEventsTable),
		"{{user_scores}}", qualify(schema, UserScoresTable),
		"{{outbox}}", qualify(schema, outboxTable),
		"{{outbox_dead}}", qualify(schema, outboxTable+"_dead"),
	).Replace(q)
}
