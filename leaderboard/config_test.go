package leaderboard

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

func TestConfig(t *testing.T) {
	t.Parallel()

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		c := (&Config{Name: "b"}).WithDefaults()
		require.Equal(t, SchemaDefault, c.Schema)
		require.Equal(t, OutboxTableDefault, c.OutboxTable)
		require.Equal(t, MinDeltaDefault, c.MinDelta)
		require.Equal(t, MaxDeltaDefault, c.MaxDelta)
		require.Equal(t, MaxUserIDLengthDefault, c.MaxUserIDLength)
		require.Equal(t, ReadPolicyDefault, c.ReadPolicy)
		require.Equal(t, MaxLagDefault, c.MaxLag)
		require.Equal(t, ReadYourWritesTimeoutDefault, c.ReadYourWritesTimeout)
		require.Equal(t, LagProbeIntervalDefault, c.LagProbeInterval)
		require.Equal(t, KeyPrefixDefault, c.KeyPrefix)
		require.Equal(t, VersionBucketsDefault, c.VersionBuckets)
		require.Equal(t, MaxSubmitsPerStatementDefault, c.MaxSubmitsPerStatement)
		require.Equal(t, SubmitStatementsDefault, c.SubmitStatements)
		require.NotNil(t, c.Logger)
		require.NoError(t, c.validate())

		// MaxLag needs only to exceed LagProbeInterval, whatever the policy.
		for _, p := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
			c = (&Config{Name: "b", ReadPolicy: p, MaxLag: time.Millisecond, LagProbeInterval: time.Millisecond - 1}).WithDefaults()
			require.NoError(t, c.validate())
		}

		// Delta bounds are a pair: one non-zero bound keeps the other.
		c = (&Config{Name: "b", MaxDelta: 50}).WithDefaults()
		require.Equal(t, int64(0), c.MinDelta)
		require.Equal(t, int64(50), c.MaxDelta)
	})

	t.Run("Invalid", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name  string
			cfg   Config
			field string
		}{
			{"NoName", Config{}, "Config.Name"},
			{"LongName", Config{Name: strings.Repeat("n", MaxNameLength+1)}, "Config.Name"},
			{"NULName", Config{Name: "a\x00"}, "Config.Name"},
			{"InvalidUTF8Name", Config{Name: "bad\xff"}, "Config.Name"},
			{"SwappedDeltas", Config{Name: "b", MinDelta: 5, MaxDelta: -5}, "Config.MinDelta"},
			{"HugeDelta", Config{Name: "b", MaxDelta: MaxScore + 1}, "Config.MaxDelta"},
			{"HugeMaxDeltaOnly", Config{Name: "b", MinDelta: -1, MaxDelta: MaxScore + 1}, "Config.MaxDelta"},
			{"HugeNegativeMinDelta", Config{Name: "b", MinDelta: MinScore - 1, MaxDelta: 1}, "Config.MinDelta"},
			{"UserIDLength", Config{Name: "b", MaxUserIDLength: MaxUserIDLengthLimit + 1}, "Config.MaxUserIDLength"},
			{"Policy", Config{Name: "b", ReadPolicy: 9}, "Config.ReadPolicy"},
			{"NegativeLag", Config{Name: "b", MaxLag: -time.Second}, "Config.MaxLag"},
			{"NegativeReadYourWritesTimeout", Config{Name: "b", ReadYourWritesTimeout: -time.Second}, "Config.ReadYourWritesTimeout"},
			{"NegativeProbeInterval", Config{Name: "b", LagProbeInterval: -time.Second}, "Config.LagProbeInterval"},
			{"LagBelowProbeInterval", Config{Name: "b", MaxLag: 50 * time.Millisecond}, "Config.MaxLag"},
			{"LagAtProbeInterval", Config{Name: "b", MaxLag: time.Second, LagProbeInterval: time.Second}, "Config.MaxLag"},
			{"ProbeIntervalAboveDefaultLag", Config{Name: "b", LagProbeInterval: time.Hour}, "Config.MaxLag"},
			{"BracePrefix", Config{Name: "b", KeyPrefix: "a{b}"}, "Config.KeyPrefix"},
			{"NegativeBuckets", Config{Name: "b", VersionBuckets: -1}, "Config.VersionBuckets"},
			{"TooManyBuckets", Config{Name: "b", VersionBuckets: projection.VersionBucketsMax + 1}, "Config.VersionBuckets"},
			{"NegativeSubmitsPerStatement", Config{Name: "b", MaxSubmitsPerStatement: -1}, "Config.MaxSubmitsPerStatement"},
			{"TooManySubmitsPerStatement", Config{Name: "b", MaxSubmitsPerStatement: MaxSubmitsPerStatementLimit + 1}, "Config.MaxSubmitsPerStatement"},
			{"NegativeSubmitStatements", Config{Name: "b", SubmitStatements: -1}, "Config.SubmitStatements"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				err := tc.cfg.WithDefaults().validate()
				require.ErrorIs(t, err, ErrInvalidConfig)
				var ce *ConfigError
				require.ErrorAs(t, err, &ce)
				require.Equal(t, tc.field, ce.Field, "names what was refused: %v", err)
			})
		}
	})

	// Every limit is inclusive: a value at it is valid.
	t.Run("AtTheLimits", func(t *testing.T) {
		t.Parallel()
		for name, cfg := range map[string]Config{
			"Name":                   {Name: strings.Repeat("n", MaxNameLength)},
			"Deltas":                 {Name: "b", MinDelta: MinScore, MaxDelta: MaxScore},
			"MaxUserIDLength":        {Name: "b", MaxUserIDLength: MaxUserIDLengthLimit},
			"VersionBuckets":         {Name: "b", VersionBuckets: projection.VersionBucketsMax},
			"MaxSubmitsPerStatement": {Name: "b", MaxSubmitsPerStatement: MaxSubmitsPerStatementLimit},
		} {
			require.NoError(t, cfg.WithDefaults().validate(), name)
		}
	})

	// Boards of one name in different schemas must not share Redis keys:
	// the default prefix includes the schema, except in "public", whose
	// boards keep the keys they always had.
	t.Run("DefaultKeyPrefixPerSchema", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, KeyPrefixDefault, (&Config{Name: "b", Schema: SchemaDefault}).WithDefaults().KeyPrefix)
		require.Equal(t, "verity:lb:tenant_a:", (&Config{Name: "b", Schema: "tenant_a"}).WithDefaults().KeyPrefix)
		require.Equal(t, "mine:", (&Config{Name: "b", Schema: "tenant_a", KeyPrefix: "mine:"}).WithDefaults().KeyPrefix, "an explicit prefix is used as given")
		keys := map[string]string{}
		for _, schema := range []string{"public", "Public", "tenant_a", "a:b", "a%3Ab", "a", "a:", "{x}", "}", " ", "ü"} {
			cfg := (&Config{Name: "weekly", Schema: schema}).WithDefaults()
			require.NoError(t, cfg.validate(), "schema %q", schema)
			require.True(t, strings.HasPrefix(cfg.KeyPrefix, KeyPrefixDefault), "schema %q: %q", schema, cfg.KeyPrefix)
			ks, err := projection.NewKeyspace(cfg.KeyPrefix)
			require.NoError(t, err, "schema %q", schema)
			key := ks.ValueKey(projection.Target{Kind: projection.KindSortedSet, Name: cfg.Name})
			require.NotContains(t, keys, key, "schemas %q and %q share a key", keys[key], schema)
			keys[key] = schema
		}
	})

	t.Run("SchemasDoNotShareRedisKeys", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		rd := testenv.Redis(t)
		name := "weekly-" + uuid.NewString() // its keys are this test's alone
		mk := func() *Board {
			pg := testenv.Postgres(t)
			cfg := &Config{Name: name, Schema: pg.Schema} // the default KeyPrefix
			require.NoError(t, Migrate(ctx, pg.Pool, cfg))
			b, err := New(pg.Pool, rd.Client, cfg)
			require.NoError(t, err)
			t.Cleanup(func() {
				require.NoError(t, testenv.DeletePrefix(context.Background(), rd.Client, b.Keyspace().Prefix()+"{"+name+"}"))
			})
			return b
		}
		a, b := mk(), mk()
		require.NotEqual(t, a.SortedSetKey(), b.SortedSetKey())
		submit := func(bd *Board, user string, delta int64) {
			_, err := bd.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: delta})
			require.NoError(t, err)
		}
		submit(a, "alice", 10)
		submit(b, "bob", 20)
		// A's ada reaches version 2 before B's ada writes version 1: in a
		// shared version hash, B's write would be dropped as stale.
		submit(a, "ada", 1)
		submit(a, "ada", 1)
		submit(b, "ada", 100)
		for _, bd := range []*Board{a, b} {
			w, err := bd.Worker(nil)
			require.NoError(t, err)
			_, err = w.Drain(ctx)
			require.NoError(t, err)
		}
		for _, bd := range []*Board{a, b} {
			top, err := bd.Top(ctx, 10, WithPolicy(ServeStale))
			require.NoError(t, err)
			auth, err := bd.Authoritative(ctx, 10)
			require.NoError(t, err)
			require.Equal(t, auth, top.Entries, "the Redis ranking of the board in %s", bd.Config().Schema)
		}
	})

	t.Run("MaxLagNotAboveProbeInterval", func(t *testing.T) {
		t.Parallel()
		err := (&Config{Name: "b", MaxLag: 50 * time.Millisecond}).WithDefaults().validate()
		require.ErrorContains(t, err, "Config.MaxLag (50ms)")
		require.ErrorContains(t, err, "Config.LagProbeInterval (100ms)")
		require.ErrorContains(t, err, "raise MaxLag or lower LagProbeInterval")
	})

	// A MaxLag below a measurement's own age is accepted, as the doc
	// says: every Redis answer is then stale, so FailClosed reads fail and
	// FallbackToPostgres reads answer from PostgreSQL.
	t.Run("MaxLagBelowAMeasurement", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.MaxLag, c.LagProbeInterval = 2*time.Nanosecond, time.Nanosecond })
		tb.submit(t, "ada", 10)
		tb.drain(t)
		ctx := context.Background()
		for range 3 {
			_, err := tb.board.Top(ctx, 10, WithPolicy(FailClosed))
			require.ErrorIs(t, err, ErrStale)
			r, err := tb.board.Top(ctx, 10, WithPolicy(FallbackToPostgres))
			require.NoError(t, err)
			require.Equal(t, SourcePostgres, r.Freshness.Source)
			require.Len(t, r.Entries, 1)
		}
	})

	t.Run("NewRefusesBadInput", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		for _, tc := range []struct {
			field string
			new   func() (*Board, error)
		}{
			{"pool", func() (*Board, error) { return New(nil, rd.Client, &Config{Name: "b"}) }},
			{"rdb", func() (*Board, error) { return New(pg.Pool, nil, &Config{Name: "b"}) }},
			{"cfg", func() (*Board, error) { return New(pg.Pool, rd.Client, nil) }},
			{"Config.Name", func() (*Board, error) { return New(pg.Pool, rd.Client, &Config{}) }},
			{"Config.MaxLag", func() (*Board, error) { return New(pg.Pool, rd.Client, &Config{Name: "b", MaxLag: -1}) }},
			{"rdb", func() (*Board, error) { return New(pg.Pool, (*redis.Client)(nil), &Config{Name: "b"}) }},
			// Checked by the outbox, reported as the board's.
			{"Config.Schema", func() (*Board, error) {
				return New(pg.Pool, rd.Client, &Config{Name: "b", Schema: strings.Repeat("s", 64)})
			}},
			{"Config.OutboxTable", func() (*Board, error) {
				return New(pg.Pool, rd.Client, &Config{Name: "b", OutboxTable: strings.Repeat("t", 64)})
			}},
		} {
			board, err := tc.new()
			require.Nil(t, board)
			require.ErrorIs(t, err, ErrInvalidConfig)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, tc.field, cfgErr.Field)
			require.NotEmpty(t, cfgErr.Reason)
		}
	})

	t.Run("MigrateIsIdempotentAndQuotesNames", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		ctx := context.Background()
		// A hostile schema name is used verbatim, never as SQL.
		cfg := &Config{Name: "b", Schema: pg.Schema + `"; DROP TABLE x; --`, KeyPrefix: rd.Prefix}
		t.Cleanup(func() {
			_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
		})
		for i := 0; i < 2; i++ {
			require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		}
		board, err := New(pg.Pool, rd.Client, cfg)
		require.NoError(t, err)
		res, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 3})
		require.NoError(t, err)
		require.Equal(t, int64(3), res.Score)
		script, err := MigrationSQL(cfg)
		require.NoError(t, err)
		require.Contains(t, script, `CREATE TABLE IF NOT EXISTS "`)
		var n int
		require.NoError(t, pg.Pool.QueryRow(ctx, "SELECT count(*) FROM "+qualify(cfg.Schema, outbox.TableDefault)).Scan(&n))
		require.Equal(t, 1, n)
	})

	t.Run("WorkerRefusesOutboxLocation", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for _, relay := range []*outbox.RelayConfig{{Table: "other"}, {Schema: "other"}, {Streams: []string{"other"}}} {
			worker, err := tb.board.Worker(&WorkerConfig{Relay: relay})
			require.Nil(t, worker)
			require.ErrorIs(t, err, ErrInvalidConfig)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, "WorkerConfig.Relay", cfgErr.Field)
		}
		worker, err := tb.board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{BatchSize: -1}})
		require.Nil(t, worker)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, "the relay's refusal is the board's")
		require.Equal(t, "WorkerConfig.Relay.BatchSize", cfgErr.Field)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "and still the outbox's")
	})

	t.Run("TypedNilMeterProvider", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		// A provider left nil to turn metrics off records nothing.
		board, err := New(pg.Pool, rd.Client, &Config{Name: "b", MeterProvider: (*sdkmetric.MeterProvider)(nil)})
		require.NoError(t, err)
		board.Close()
	})

	t.Run("NotMadeByNew", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		cmd := Command{EventID: uuid.New(), UserID: "u", Delta: 1}
		refused := func(t *testing.T, field, method string, err error) {
			t.Helper()
			require.ErrorIs(t, err, ErrInvalidConfig, method)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, method)
			require.Equal(t, field, cfgErr.Field, method)
		}
		for name, b := range map[string]*Board{"Zero": new(Board), "Nil": nil} {
			t.Run("Board"+name, func(t *testing.T) {
				t.Parallel()
				for method, call := range map[string]func() error{
					"Submit":        func() error { _, err := b.Submit(ctx, cmd); return err },
					"SubmitTx":      func() error { _, err := b.SubmitTx(ctx, nil, cmd); return err },
					"SubmitBatch":   func() error { _, err := b.SubmitBatch(ctx, []Command{cmd}); return err },
					"SubmitBatchTx": func() error { _, err := b.SubmitBatchTx(ctx, nil, []Command{cmd}); return err },
					"Top":           func() error { _, err := b.Top(ctx, 10); return err },
					"Page":          func() error { _, err := b.Page(ctx, "", 10); return err },
					"Rank":          func() error { _, _, err := b.Rank(ctx, "u"); return err },
					"Around":        func() error { _, err := b.Around(ctx, "u", 1); return err },
					"Authoritative": func() error { _, err := b.Authoritative(ctx, 10); return err },
					"Worker":        func() error { _, err := b.Worker(nil); return err },
					"Reconciler":    func() error { _, err := b.Reconciler(nil); return err },
					"Verify":        func() error { _, _, err := b.Verify(ctx, nil); return err },
					"Source.Page":   func() error { _, err := b.Source().Page(ctx, reconcile.Cursor{}, 10); return err },
					"Source.Sample": func() error { _, err := b.Source().Sample(ctx, 10); return err },
					"Source.Lookup": func() error { _, err := b.Source().Lookup(ctx, []string{"u"}); return err },
					"Mapper": func() error {
						_, err := b.Mapper().Map(outbox.Record{Message: outbox.Message{Stream: "leaderboard:b", Key: "u", Version: 1, Payload: []byte("1")}})
						return err
					},
				} {
					refused(t, "Board", method, call())
				}
				require.Equal(t, int64(-1), int64(b.Freshness(ctx).Lag), "the lag of no board cannot be measured")
				require.Empty(t, b.Name())
				require.Empty(t, b.Stream())
				require.Empty(t, b.SortedSetKey())
				require.Equal(t, Config{}, b.Config())
				require.Equal(t, projection.Keyspace{}, b.Keyspace())
				b.Close()
			})
		}
		for name, w := range map[string]*Worker{"Zero": new(Worker), "Nil": nil} {
			t.Run("Worker"+name, func(t *testing.T) {
				t.Parallel()
				refused(t, "Worker", "Run", w.Run(ctx))
				_, err := w.RunOnce(ctx)
				refused(t, "Worker", "RunOnce", err)
				_, err = w.Drain(ctx)
				refused(t, "Worker", "Drain", err)
				require.Nil(t, w.Relay())
				require.Nil(t, w.Projector())
			})
		}
	})

	t.Run("MigrateRefusesBadInput", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		var cfgErr *ConfigError
		require.ErrorAs(t, Migrate(ctx, nil, &Config{}), &cfgErr)
		require.Equal(t, "db", cfgErr.Field)
		pg := testenv.Postgres(t)
		require.ErrorAs(t, Migrate(ctx, pg.Pool, &Config{Schema: strings.Repeat("s", 64)}), &cfgErr)
		require.Equal(t, "Config.Schema", cfgErr.Field)
		// A released pooled connection is Migrate's db, not a Config field.
		released, err := pg.Pool.Acquire(ctx)
		require.NoError(t, err)
		released.Release()
		require.ErrorAs(t, Migrate(ctx, released, &Config{Schema: pg.Schema}), &cfgErr)
		require.Equal(t, "db", cfgErr.Field)
	})

	// MigrationSQL refuses what Migrate and New refuse, rather than return
	// the SQL of another schema: pgx drops a NUL byte from a quoted name
	// ("a\x00b" would become "ab"), and PostgreSQL truncates a name to 63
	// bytes.
	t.Run("MigrationSQLRefusesWhatMigrateRefuses", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		for _, tc := range []struct {
			field string
			cfg   Config
		}{
			{"Config.Schema", Config{Schema: "a\x00b"}},
			{"Config.Schema", Config{Schema: "a\xffb"}},
			{"Config.Schema", Config{Schema: strings.Repeat("s", 64)}},
			{"Config.OutboxTable", Config{OutboxTable: "o\x00x"}},
			{"Config.OutboxTable", Config{OutboxTable: strings.Repeat("t", 64)}},
			{"Config.OutboxTable", Config{OutboxTable: UserScoresTable}},
		} {
			name := fmt.Sprintf("Schema %q OutboxTable %q", tc.cfg.Schema, tc.cfg.OutboxTable)
			script, err := MigrationSQL(&tc.cfg)
			require.Empty(t, script, name)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, name)
			require.Equal(t, tc.field, cfgErr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)

			require.ErrorAs(t, Migrate(context.Background(), pg.Pool, &tc.cfg), &cfgErr, "Migrate refuses it too")
			require.Equal(t, tc.field, cfgErr.Field)
			named := tc.cfg
			named.Name = "b"
			_, err = New(pg.Pool, rd.Client, &named)
			require.ErrorAs(t, err, &cfgErr, "and New")
			require.Equal(t, tc.field, cfgErr.Field)
		}
		script, err := MigrationSQL(nil)
		require.NoError(t, err)
		require.Contains(t, script, `"public"."user_scores"`)
	})
}
