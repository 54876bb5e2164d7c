package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/reconcile"
)

// runCommand runs the binary's entry point in-process and returns its exit
// code and outputs.
func runCommand(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(t.Context(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// runJSON runs a subcommand with --json and decodes its output into v.
func (tb *testBundle) runJSON(t *testing.T, v any, cmd string, args ...string) {
	t.Helper()
	code, stdout, stderr := runCommand(t, append(append([]string{cmd, "--json"}, tb.opsFlags()...), args...)...)
	require.Equal(t, exitOK, code, "stderr: %s", stderr)
	require.NoError(t, json.Unmarshal([]byte(stdout), v), "stdout: %s", stdout)
}

// seed submits scores through the API and projects them.
func (tb *testBundle) seed(t *testing.T, scores map[string]int) {
	t.Helper()
	for user, delta := range scores {
		res := tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":%d}`, user, delta))
		require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
	}
	tb.drain(t)
}

// deadLetter appends an outbox row for the board that its projection
// cannot parse, and has a one-attempt worker dead-letter it.
func (tb *testBundle) deadLetter(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(&outbox.Config{Schema: tb.pg.Schema})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, tb.pg.Pool, func(tx pgx.Tx) error {
		return w.Append(ctx, tx, outbox.Message{EventID: uuid.New(), Stream: tb.board.Stream(), Key: "mallory", Version: 1, Payload: []byte("not a score")})
	}))
	worker, err := tb.board.Worker(&leaderboard.WorkerConfig{Relay: &outbox.RelayConfig{MaxAttempts: 1}})
	require.NoError(t, err)
	n, err := worker.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

func TestStatsCommand(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, user := range []string{"ada", "bob", "ada"} {
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":5}`, user)).status)
	}

	var st statsJSON
	tb.runJSON(t, &st, "stats")
	require.Equal(t, testBoard, st.Board)
	require.EqualValues(t, 3, st.Pending, "one outbox row per submit")
	require.Positive(t, st.OldestPendingAgeMS)
	require.Zero(t, st.DeadLetters)
	require.Positive(t, st.Freshness.LagMS, "nothing projected yet")

	tb.drain(t)
	tb.deadLetter(t)
	st = statsJSON{}
	tb.runJSON(t, &st, "stats")
	require.Zero(t, st.Pending)
	require.Zero(t, st.OldestPendingAgeMS)
	require.EqualValues(t, 1, st.DeadLetters)

	code, stdout, stderr := runCommand(t, append([]string{"stats"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, stderr)
	require.Regexp(t, `(?m)^dead letters\s+1\s+\(all streams\)$`, stdout)
	require.Regexp(t, `(?m)^outbox pending\s+0\s`, stdout)
	require.Contains(t, stdout, fmt.Sprintf("'leaderboard-service replay-dead', which moves back this board's (stream %q)", tb.board.Stream()))
	require.False(t, st.Freshness.Unverified)

	// Measured as a service run with --require-verified: no full pass has
	// verified this board, so its lag is unknown, and stats says why.
	st = statsJSON{}
	tb.runJSON(t, &st, "stats", "--require-verified")
	require.True(t, st.Freshness.Unverified)
	require.Negative(t, st.Freshness.LagMS)
	code, stdout, stderr = runCommand(t, append([]string{"stats", "--require-verified"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, stderr)
	require.Contains(t, stdout, "not verified")
	// The long reason is no column cell: it used to pad the dead-letter
	// count's column to its own length, some 110 spaces.
	require.Regexp(t, `(?m)^dead letters\s{1,8}1\s{1,8}\(all streams\)$`, stdout)
}

// A Redis that cannot be reached is an error (exit 1, named on stderr), not
// a board that "is not verified" because Redis lost its data.
func TestStatsCommandRedisDown(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	flags := []string{"--database-url=" + tb.pg.ConnString, "--redis-url=redis://127.0.0.1:1",
		"--schema=" + tb.pg.Schema, "--key-prefix=" + tb.rd.Prefix, "--board=" + testBoard}
	// Without --require-verified too: the lag, the outbox's alone, read 0
	// and the report said everything before now "is visible".
	for _, args := range [][]string{{"stats"}, {"stats", "--json"}, {"stats", "--require-verified"}, {"stats", "--require-verified", "--json"}} {
		code, stdout, stderr := runCommand(t, append(args, flags...)...)
		require.Equal(t, exitError, code, "%v: %s%s", args, stdout, stderr)
		require.NotContains(t, stdout, "not verified", args)
		require.Contains(t, stderr, "redis: ", args)
		require.Contains(t, stderr, "127.0.0.1:1", args)
	}
}

func TestReconcileCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.seed(t, map[string]int{"ada": 30, "bob": 20, "cy": 10})
	// A hand edit: bob's projected score no longer matches PostgreSQL
	// (the sorted set holds negated scores).
	require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redisZ(-999, "bob")).Err())

	var dry reconcileSummary
	tb.runJSON(t, &dry, "reconcile", "--dry-run")
	require.True(t, dry.DryRun)
	require.False(t, dry.Sampled)
	require.EqualValues(t, 3, dry.Checked)
	require.Equal(t, map[string]int64{"current": 2, "corrupt": 1}, dry.Counts)
	require.Equal(t, map[string]int64{"dry-run": 1}, dry.Results)
	require.Zero(t, dry.Repaired)
	require.Equal(t, -999.0, tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "bob").Val(), "a dry run writes nothing")

	code, stdout, stderr := runCommand(t, append([]string{"reconcile"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, stderr)
	require.Regexp(t, `(?m)^\s+corrupt\s+1$`, stdout)
	require.Contains(t, stdout, "repaired 1")
	require.Equal(t, -20.0, tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "bob").Val(), "repaired from PostgreSQL")

	var sampled reconcileSummary
	tb.runJSON(t, &sampled, "reconcile", "--sample=2")
	require.True(t, sampled.Sampled)
	require.EqualValues(t, 2, sampled.Checked)
	require.Zero(t, sampled.Drift)
	require.Nil(t, sampled.Verified)

	// --verify: a full pass that records the projection as complete.
	require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "cy").Err())
	var verifying reconcileSummary
	tb.runJSON(t, &verifying, "reconcile", "--verify")
	require.NotNil(t, verifying.Verified)
	require.True(t, *verifying.Verified)
	require.EqualValues(t, 1, verifying.Repaired)
	code, stdout, stderr = runCommand(t, append([]string{"reconcile", "--verify"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, stderr)
	require.Contains(t, stdout, "verified: the projection is recorded as complete")

	// A pass that runs but does not verify exits 3, so that a script can
	// tell: an orphan (a member PostgreSQL does not have) is only reported,
	// and stands in the way.
	require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redisZ(-5, "mallory")).Err())
	code, stdout, stderr = runCommand(t, append([]string{"reconcile", "--verify"}, tb.opsFlags()...)...)
	require.Equal(t, exitNotVerified, code, "stdout: %s\nstderr: %s", stdout, stderr)
	require.Contains(t, stdout, "NOT verified: the pass left ahead or orphan entries in place")
	require.Regexp(t, `(?m)^\s+orphan\s+1$`, stdout)
	require.Contains(t, stderr, "leaderboard-service reconcile: the projection was not verified")
	code, stdout, stderr = runCommand(t, append([]string{"reconcile", "--verify", "--json"}, tb.opsFlags()...)...)
	require.Equal(t, exitNotVerified, code, "stderr: %s", stderr)
	var unverified reconcileSummary
	require.NoError(t, json.Unmarshal([]byte(stdout), &unverified), "stdout: %s", stdout)
	require.NotNil(t, unverified.Verified)
	require.False(t, *unverified.Verified)
	require.Empty(t, unverified.Error, "the pass itself did not fail")
}

func TestRebuildCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.seed(t, map[string]int{"ada": 30, "bob": 20, "cy": 10})
	// Redis lost the board (an eviction, a restart without persistence).
	require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey()).Err())

	var out rebuildJSON
	tb.runJSON(t, &out, "rebuild")
	require.True(t, out.Switched)
	require.EqualValues(t, 3, out.Rows)
	require.EqualValues(t, 3, out.Applied)

	res := tb.do(t, http.MethodGet, "/leaderboard", nil, "").json(t)
	require.Len(t, res["entries"], 3)
	require.Equal(t, "ada", res["entries"].([]any)[0].(map[string]any)["user_id"])
}

func TestReplayDeadCommand(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.deadLetter(t)

	var out replayJSON
	tb.runJSON(t, &out, "replay-dead")
	require.EqualValues(t, 1, out.Moved)
	require.Equal(t, tb.board.Stream(), out.Stream)

	var st statsJSON
	tb.runJSON(t, &st, "stats")
	require.Zero(t, st.DeadLetters)
	require.EqualValues(t, 1, st.Pending, "the row is back in the outbox")

	code, stdout, stderr := runCommand(t, append([]string{"replay-dead"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, stderr)
	require.Contains(t, stdout, "moved 0 dead letters")
}

func TestCommandLine(t *testing.T) {
	t.Parallel()
	// Servers that cannot answer: a case that exits 2 with them was
	// refused before anything connected.
	nowhere := []string{"--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--redis-url=redis://127.0.0.1:1"}
	for _, tc := range []struct {
		name string
		args []string
		code int
		err  string
	}{
		{"UnknownCommand", []string{"frobnicate"}, exitUsage, `unknown command "frobnicate"`},
		{"UnknownFlag", []string{"stats", "--nope"}, exitUsage, "flag provided but not defined"},
		{"ServeFlagOnOps", []string{"stats", "--addr=:1"}, exitUsage, "flag provided but not defined"},
		{"UnknownReadPolicy", []string{"serve", "--read-policy=optimistic"}, exitUsage, `unknown policy "optimistic"`},
		// An unset variable ("--read-policy=$POLICY"), not serve-stale.
		{"EmptyReadPolicy", append([]string{"serve", "--addr=127.0.0.1:0", "--read-policy="}, nowhere...), exitUsage, "--read-policy must not be empty"},
		{"NegativeSample", []string{"reconcile", "--sample=-1"}, exitUsage, "must not be negative"},
		{"VerifySampled", []string{"reconcile", "--verify", "--sample=3"}, exitUsage, "--verify runs a full pass"},
		{"ExtraArgument", []string{"rebuild", "now"}, exitUsage, `unexpected argument "now"`},
		{"BadLogLevel", []string{"stats", "--log-level=loud", "--database-url=postgres://127.0.0.1:1/x", "--redis-url=redis://127.0.0.1:1"}, exitUsage, "--log-level"},
		{"BadLogLevelServe", []string{"serve", "--log-level=verbose"}, exitUsage, "--log-level"},
		{"EmptyBoard", []string{"stats", "--board="}, exitUsage, "--board must not be empty"},
		{"MaxLagNotAboveProbeInterval", []string{"serve", "--max-lag=100ms"}, exitUsage, "--max-lag 100ms must exceed"},
		// Not the board's default (5 s) read as fresh by a service asked
		// for no lag at all.
		{"MaxLagZero", append([]string{"serve", "--addr=127.0.0.1:0", "--read-policy=fail-closed", "--max-lag=0"}, nowhere...), exitUsage, "--max-lag 0s must exceed"},
		{"AllowedHostsWithPort", append([]string{"serve", "--addr=127.0.0.1:0", "--allowed-hosts=a.example:80"}, nowhere...), exitUsage, "--allowed-hosts: \"a.example:80\""},
		// The board's own rules (leaderboard.New), checked before connecting.
		{"KeyPrefixWithBraces", append([]string{"stats", "--key-prefix={x}:"}, nowhere...), exitUsage, "must not contain '{' or '}'"},
		{"BoardTooLong", append([]string{"stats", "--board=" + strings.Repeat("b", leaderboard.MaxNameLength+1)}, nowhere...), exitUsage, "at most 200 bytes"},
		{"BoardNotUTF8", append([]string{"reconcile", "--board=\xff"}, nowhere...), exitUsage, "--board must be valid UTF-8"},
		// An unset variable ("--schema=$SCHEMA"), not a request for public.
		{"EmptySchema", append([]string{"reconcile", "--schema="}, nowhere...), exitUsage, "--schema must not be empty"},
		// The same for the flags whose default is empty: not servers
		// looked for elsewhere, the board's default keys, or the default
		// host check (any host on a non-loopback --addr).
		{"EmptyDatabaseURL", []string{"stats", "--schema=never_migrated", "--database-url=", "--redis-url=redis://127.0.0.1:1"}, exitUsage, "--database-url must not be empty (omit it for $DATABASE_URL"},
		{"EmptyRedisURL", []string{"rebuild", "--schema=never_migrated", "--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--redis-url="}, exitUsage, "--redis-url must not be empty (omit it for $REDIS_URL"},
		{"EmptyClusterRedisURL", []string{"stats", "--redis-cluster", "--redis-url=", "--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2"}, exitUsage, "--redis-url must not be empty (omit it for $REDIS_URL)"},
		{"EmptyKeyPrefix", append([]string{"reconcile", "--verify", "--key-prefix="}, nowhere...), exitUsage, "--key-prefix must not be empty"},
		{"EmptyAllowedHosts", append([]string{"serve", "--addr=0.0.0.0:0", "--allowed-hosts="}, nowhere...), exitUsage, "--allowed-hosts must not be empty"},
		{"SchemaNotUTF8", append([]string{"rebuild", "--schema=\xff"}, nowhere...), exitUsage, "--schema must be valid UTF-8"},
		{"SchemaTooLong", append([]string{"stats", "--schema=" + strings.Repeat("s", 64)}, nowhere...), exitUsage, "--schema is 64 bytes long"},
		{"SampleAboveMax", append([]string{"reconcile", fmt.Sprintf("--sample=%d", reconcile.SampleMax+1)}, nowhere...), exitUsage, "--sample 1000001 is above reconcile.SampleMax"},
		{"ReconcileSampleAboveMax", append([]string{"serve", "--addr=127.0.0.1:0", fmt.Sprintf("--reconcile-sample=%d", reconcile.SampleMax+1)}, nowhere...), exitUsage, "--reconcile-sample 1000001 is above reconcile.SampleMax"},
		{"DatabaseURLMalformed", []string{"stats", "--database-url=notaurl", "--redis-url=redis://127.0.0.1:1"}, exitUsage, "--database-url: "},
		{"RedisURLMalformed", []string{"stats", "--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--redis-url=notaurl"}, exitUsage, "--redis-url: "},
		{"ClusterSeedsMalformed", []string{"stats", "--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--redis-cluster", "--redis-url=notaurl"}, exitUsage, "--redis-url: "},
		{"AddrWithoutPort", append([]string{"serve", "--addr=bogus"}, nowhere...), exitUsage, "--addr: address bogus: missing port"},
		{"AddrPortNotANumber", append([]string{"serve", "--addr=127.0.0.1:http"}, nowhere...), exitUsage, "the port must be a number"},
		{"AddrPortTooLarge", append([]string{"serve", "--addr=:65536"}, nowhere...), exitUsage, "the port must be a number"},
		// Asked-for help is not a usage error; a bare -h lists the commands
		// as well as the default command's flags.
		{"Help", []string{"-h"}, exitOK, "replay-dead"},
		{"HelpShowsServeFlags", []string{"--help"}, exitOK, "-read-policy"},
		{"CommandHelp", []string{"stats", "-h"}, exitOK, "-json"},
		{"UnreachableDatabase", []string{"stats", "--database-url=postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--redis-url=redis://127.0.0.1:1"}, exitError, "migrate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := runCommand(t, tc.args...)
			require.Equal(t, tc.code, code, stderr)
			require.Contains(t, stderr, tc.err)
		})
	}
}

// TestRedisURLPasswordNotPrinted: a Redis URL go-redis cannot parse, from
// --redis-url or REDIS_URL, with or without --redis-cluster, is a usage
// error that names the URL without its password, whole or in pieces (the
// same mistake in --database-url prints postgres://bob:xxxxx@...).
func TestRedisURLPasswordNotPrinted(t *testing.T) {
	t.Parallel()
	// Qz9 and Wk7 around whatever makes the URL fail, so a piece of the
	// password shows as well as the whole.
	for name, bad := range map[string]string{
		"BadPort":         "redis://bob:Qz9Wk7@127.0.0.1:port/0",
		"SlashInPassword": "redis://bob:Qz9/Wk7@127.0.0.1:6379/0",
		"HashInPassword":  "redis://bob:Qz9#Wk7@127.0.0.1:6379/0",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for _, cluster := range [][]string{nil, {"--redis-cluster"}} {
				code, _, stderr := runCommand(t, append([]string{"stats", "--redis-url=" + bad}, cluster...)...)
				require.Equal(t, exitUsage, code, "stderr: %s", stderr)
				require.Contains(t, stderr, "--redis-url: parse \"redis://bob:xxxxx@127.0.0.1:")
				for _, piece := range []string{"Qz9", "Wk7"} {
					require.NotContains(t, stderr, piece, "--redis-url %v printed the password", cluster)
				}

				// The same URL in REDIS_URL, which connect parses.
				o, err := parseFlags("stats", cluster, io.Discard)
				require.NoError(t, err)
				o.getenv = func(k string) string {
					if k == "REDIS_URL" {
						return bad
					}
					return ""
				}
				_, err = connect(t.Context(), o, slog.New(slog.DiscardHandler))
				require.ErrorAs(t, err, new(usageError))
				require.ErrorContains(t, err, "REDIS_URL: parse \"redis://bob:xxxxx@127.0.0.1:")
				for _, piece := range []string{"Qz9", "Wk7"} {
					require.NotContains(t, err.Error(), piece, "REDIS_URL %v: the password is in the error", cluster)
				}
			}
		})
	}
}

// Without --key-prefix the board picks its prefix, which differs per
// schema: two tenants' boards of one name must not share Redis keys.
func TestKeyPrefixDefaultsToTheBoards(t *testing.T) {
	t.Parallel()
	prefixOf := func(args ...string) string {
		o, err := parseFlags("stats", args, io.Discard)
		require.NoError(t, err)
		return (&leaderboard.Config{Name: o.board, Schema: o.schema, KeyPrefix: o.keyPrefix}).WithDefaults().KeyPrefix
	}
	require.Equal(t, leaderboard.KeyPrefixDefault, prefixOf())
	tenantA, tenantB := prefixOf("--schema=tenant_a"), prefixOf("--schema=tenant_b")
	require.NotEqual(t, tenantA, tenantB)
	require.NotEqual(t, leaderboard.KeyPrefixDefault, tenantA)
	require.Equal(t, "custom:", prefixOf("--schema=tenant_a", "--key-prefix=custom:"))
}

// TestServeBindsBeforeMigrating: an address serve cannot listen on (here,
// one in use) fails before the board's tables are created.
func TestServeBindsBeforeMigrating(t *testing.T) {
	t.Parallel()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = taken.Close() })
	schema := pg.Schema + "_serve"
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})

	code, _, stderr := runCommand(t, "serve", "--addr="+taken.Addr().String(),
		"--database-url="+pg.ServerURL, "--redis-url="+rd.URL, "--schema="+schema, "--key-prefix="+rd.Prefix, "--board="+testBoard)
	require.Equal(t, exitError, code, stderr)
	require.Contains(t, stderr, "address already in use")
	var tables int
	require.NoError(t, pg.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_tables WHERE schemaname = $1`, schema).Scan(&tables))
	require.Zero(t, tables, "serve migrated before finding it could not listen")
}

func redisZ(score float64, member string) redis.Z { return redis.Z{Score: score, Member: member} }

// TestRedisCluster runs the ops subcommands with --redis-cluster against a
// real three-master cluster, with a board whose worker projects through a
// cluster client.
func TestRedisCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	cluster := testenv.SharedRedisCluster(t)
	client := cluster.Client(t)
	prefix := cluster.Prefix(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: prefix}
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, client, cfg)
	require.NoError(t, err)
	for _, user := range []string{"ada", "bob", "cy"} {
		_, err := board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: user, Delta: 10})
		require.NoError(t, err)
	}
	worker, err := board.Worker(nil)
	require.NoError(t, err)
	_, err = worker.Drain(ctx)
	require.NoError(t, err)
	require.NoError(t, client.ZAdd(ctx, board.SortedSetKey(), redisZ(-999, "bob")).Err())

	addrs := cluster.Addrs()
	seed := "redis://" + addrs[0] + "?addr=" + strings.Join(addrs[1:], "&addr=")
	flags := []string{"--json", "--redis-cluster", "--redis-url=" + seed, "--database-url=" + pg.ConnString,
		"--schema=" + pg.Schema, "--key-prefix=" + prefix, "--board=" + testBoard}

	code, stdout, stderr := runCommand(t, append([]string{"reconcile"}, flags...)...)
	require.Equal(t, exitOK, code, stderr)
	var sum reconcileSummary
	require.NoError(t, json.Unmarshal([]byte(stdout), &sum), stdout)
	require.Equal(t, map[string]int64{"current": 2, "corrupt": 1}, sum.Counts)
	require.EqualValues(t, 1, sum.Repaired)
	require.Equal(t, -10.0, client.ZScore(ctx, board.SortedSetKey(), "bob").Val())

	require.NoError(t, client.Del(ctx, board.SortedSetKey()).Err())
	code, stdout, stderr = runCommand(t, append([]string{"rebuild"}, flags...)...)
	require.Equal(t, exitOK, code, stderr)
	var rb rebuildJSON
	require.NoError(t, json.Unmarshal([]byte(stdout), &rb), stdout)
	require.True(t, rb.Switched)
	require.EqualValues(t, 3, client.ZCard(ctx, board.SortedSetKey()).Val())
}

// TestConnectServers: a server given by its flag is used as given, whatever
// the environment says; only a server without a flag is resolved; a
// cluster's seed list comes from the flag or REDIS_URL and is never
// resolved like a single server.
func TestConnectServers(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	deadPG := "postgres://postgres@127.0.0.1:1/x?connect_timeout=1"
	deadRedis := "redis://127.0.0.1:1/0"
	connectWith := func(t *testing.T, env map[string]string, flags ...string) (*deps, error) {
		t.Helper()
		o, err := parseFlags("stats", append([]string{"--schema=" + tb.pg.Schema, "--key-prefix=" + tb.rd.Prefix, "--board=" + testBoard}, flags...), io.Discard)
		require.NoError(t, err)
		o.getenv = func(k string) string { return env[k] }
		d, err := connect(t.Context(), o, slog.New(slog.DiscardHandler))
		if err == nil {
			t.Cleanup(d.close)
		}
		return d, err
	}

	t.Run("FlagsWinOverTheEnvironment", func(t *testing.T) {
		t.Parallel()
		d, err := connectWith(t, map[string]string{"DATABASE_URL": deadPG, "REDIS_URL": deadRedis},
			"--database-url="+tb.pg.ConnString, "--redis-url="+tb.rd.URL)
		require.NoError(t, err)
		require.NoError(t, d.pool.Ping(t.Context()))
		require.NoError(t, d.rdb.Ping(t.Context()).Err())
	})

	t.Run("OnlyTheMissingServerIsResolved", func(t *testing.T) {
		t.Parallel()
		d, err := connectWith(t, map[string]string{"DATABASE_URL": deadPG, "REDIS_URL": tb.rd.URL},
			"--database-url="+tb.pg.ConnString)
		require.NoError(t, err, "the stale DATABASE_URL must not matter when --database-url is given")
		require.NoError(t, d.rdb.Ping(t.Context()).Err())

		_, err = connectWith(t, map[string]string{"DATABASE_URL": tb.pg.ConnString, "REDIS_URL": deadRedis},
			"--database-url="+tb.pg.ConnString)
		require.ErrorContains(t, err, "REDIS_URL is set but does not answer", "the server without a flag is still resolved")
	})

	t.Run("ClusterSeedListFromTheEnvironment", func(t *testing.T) {
		t.Parallel()
		d, err := connectWith(t, map[string]string{"REDIS_URL": "redis://127.0.0.1:7001?addr=127.0.0.1:7002&addr=127.0.0.1:7003"},
			"--database-url="+tb.pg.ConnString, "--redis-cluster")
		require.NoError(t, err)
		cc, ok := d.rdb.(*redis.ClusterClient)
		require.True(t, ok, "a cluster client, got %T", d.rdb)
		require.Equal(t, []string{"127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"}, cc.Options().Addrs)

		// Without a seed list anywhere, or with one that cannot be parsed,
		// the command is misused (exit 2), as with a bad flag.
		_, err = connectWith(t, nil, "--database-url="+tb.pg.ConnString, "--redis-cluster")
		require.ErrorContains(t, err, "--redis-cluster needs a seed list")
		require.ErrorAs(t, err, new(usageError))
		_, err = connectWith(t, map[string]string{"REDIS_URL": "notaurl"}, "--database-url="+tb.pg.ConnString, "--redis-cluster")
		require.ErrorContains(t, err, "REDIS_URL: ")
		require.ErrorAs(t, err, new(usageError))
	})

	// A variable a flag leaves it to is parsed as the flag would be: a
	// malformed one is a usage error (exit 2) found before anything
	// connects, not a server that does not answer.
	t.Run("MalformedURLInTheEnvironment", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			env   map[string]string
			flags []string
		}{
			"DATABASE_URL": {map[string]string{"DATABASE_URL": "postgres://x:notaport/db"}, []string{"--redis-url=" + deadRedis}},
			"REDIS_URL":    {map[string]string{"REDIS_URL": "notaurl"}, []string{"--database-url=" + deadPG}},
		} {
			_, err := connectWith(t, tc.env, tc.flags...)
			require.ErrorContains(t, err, name+": ", name)
			require.ErrorAs(t, err, new(usageError), name)
		}
		// Unused when its flag is given.
		d, err := connectWith(t, map[string]string{"DATABASE_URL": "postgres://x:notaport/db", "REDIS_URL": "notaurl"},
			"--database-url="+tb.pg.ConnString, "--redis-url="+tb.rd.URL)
		require.NoError(t, err)
		require.NoError(t, d.rdb.Ping(t.Context()).Err())
	})
}

// --disable-notify is serve's only way to run behind a transaction-pooling
// proxy, where LISTEN cannot work.
func TestDisableNotifyFlag(t *testing.T) {
	t.Parallel()
	o, err := parseFlags("serve", nil, io.Discard)
	require.NoError(t, err)
	require.False(t, o.disableNotify)
	o, err = parseFlags("serve", []string{"--disable-notify"}, io.Discard)
	require.NoError(t, err)
	require.True(t, o.disableNotify)
	_, err = parseFlags("stats", []string{"--disable-notify"}, io.Discard)
	require.Error(t, err, "only serve runs a worker")
}

// TestDatabaseURLPasswordNotPrinted: a keyword/value connection string
// libpq and pgx accept with the password written in a way pgx's own masking
// misses (spaces around '=', a space after it, an escaped space inside the
// value, sslpassword), with another mistake in it, is a usage error that
// does not print the password, from --database-url or DATABASE_URL (README:
// "no password in any log line or error"). It printed the string whole.
func TestDatabaseURLPasswordNotPrinted(t *testing.T) {
	t.Parallel()
	for name, bad := range map[string]string{
		"SpacesAroundEquals": "host=127.0.0.1 user=bob password = Qz9Wk7 port=zz",
		"SpaceBeforeValue":   "host=127.0.0.1 user=bob password= Qz9Wk7 port=zz",
		"EscapedSpace":       `host=127.0.0.1 user=bob password=Qz9\ Wk7 port=zz`,
		"SSLPassword":        "host=127.0.0.1 user=bob sslpassword = Qz9Wk7 port=zz",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := runCommand(t, "stats", "--database-url="+bad, "--redis-url=redis://127.0.0.1:1")
			require.Equal(t, exitUsage, code, "stderr: %s", stderr)
			require.Contains(t, stderr, "--database-url: cannot parse `(keyword/value connection string not shown")
			require.Contains(t, stderr, "invalid port", "pgx's reason is kept")
			for _, piece := range []string{"Qz9", "Wk7"} {
				require.NotContains(t, stderr, piece, "--database-url printed the password")
			}

			o, err := parseFlags("stats", []string{"--redis-url=redis://127.0.0.1:1"}, io.Discard)
			require.NoError(t, err)
			o.getenv = func(k string) string {
				if k == "DATABASE_URL" {
					return bad
				}
				return ""
			}
			_, err = connect(t.Context(), o, slog.New(slog.DiscardHandler))
			require.ErrorAs(t, err, new(usageError))
			for _, piece := range []string{"Qz9", "Wk7"} {
				require.NotContains(t, err.Error(), piece, "DATABASE_URL: the password is in the error")
			}
		})
	}
	// A URL keeps pgx's masking, which shows the rest of it.
	code, _, stderr := runCommand(t, "stats", "--database-url=postgres://bob:Qz9Wk7@127.0.0.1:zz/db", "--redis-url=redis://127.0.0.1:1")
	require.Equal(t, exitUsage, code, "stderr: %s", stderr)
	require.Contains(t, stderr, "postgres://bob:xxxxx@127.0.0.1:zz/db")
}
