package faults

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
	"github.com/verity-go/verity/versioncache"
)

// hostileUsers are user ids that would break naive SQL or key building.
var hostileUsers = []string{
	"robert'); DROP TABLE user_scores; --",
	`"; DELETE FROM score_events; --`,
	"a;b;c",
	"{slot}",
	"}{",
	"x}:{y",
	"::",
	"%",
	"%7B",
	"\\'\\\"",
	"$1",
	"line\nbreak\ttab",
	"🙂 ünïcode",
	"verity:lb:{weekly}:z",
}

// exercise runs every operation of a board over users: submits (single and
// batch), a drain, reads, a reconcile pass and a rebuild, and checks the
// projection equals the source and that user ids come back verbatim.
func exercise(t *testing.T, bb *boardBundle, users []string) {
	t.Helper()
	ctx := context.Background()
	for i, u := range users {
		_, err := bb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: u, Delta: int64(10 + i)})
		require.NoError(t, err, "user %q", u)
	}
	batch := make([]leaderboard.Command, len(users))
	for i, u := range users {
		batch[i] = leaderboard.Command{EventID: uuid.New(), UserID: u, Delta: 1}
	}
	_, err := bb.board.SubmitBatch(ctx, batch)
	require.NoError(t, err)
	_, err = bb.worker(t, "exercise").Drain(ctx)
	require.NoError(t, err)

	top, err := bb.board.Top(ctx, leaderboard.MaxPageSize)
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, e := range top.Entries {
		seen[e.UserID] = true
	}
	for _, u := range users {
		require.True(t, seen[u], "user %q did not come back verbatim from Redis", u)
		_, _, err := bb.board.Rank(ctx, u)
		require.NoError(t, err, "rank of %q", u)
	}
	auth, err := bb.board.Authoritative(ctx, leaderboard.MaxPageSize)
	require.NoError(t, err)
	require.Len(t, auth, len(users))
	rep := bb.reconcile(t)
	require.Zero(t, rep.Drift())
	rec, err := bb.board.Reconciler(nil)
	require.NoError(t, err)
	_, err = rec.Rebuild(ctx)
	require.NoError(t, err)
	bb.requireConverged(t)
}

// TestHostileIdentifiers configures a board whose schema, outbox table,
// board name and key prefix are SQL injection attempts, feeds it user ids
// that are too, and checks that everything works, the names are used
// verbatim, and a canary table in another schema survives.
func TestHostileIdentifiers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	canary := testenv.Postgres(t)
	_, err := canary.Pool.Exec(ctx, `CREATE TABLE user_scores (x int); CREATE TABLE score_events (x int); CREATE TABLE verity_outbox (x int)`)
	require.NoError(t, err)

	schema := `f";DROP SCHEMA ` + canary.Schema + ` CASCADE;--` + services.RandomSuffix(4)
	if len(schema) > 63 { // PostgreSQL's identifier limit; keep the attack, drop the target
		schema = `f";DROP SCHEMA x CASCADE;--` + services.RandomSuffix(4)
	}
	t.Cleanup(func() {
		_, _ = canary.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
	})
	rd := testenv.Redis(t)
	bb := newBoard(t, canary.Pool, schema, rd.Client, rd.Prefix+`"'; FLUSHALL; `, `week'); DROP TABLE user_scores; --{x}:y`,
		func(c *leaderboard.Config) { c.OutboxTable = `outbox"; DROP TABLE score_events; --` })
	exercise(t, bb, hostileUsers)

	var tables []string
	rows, err := canary.Pool.Query(ctx, `SELECT table_schema || '.' || table_name FROM information_schema.tables WHERE table_schema IN ($1, $2) ORDER BY 1`, schema, canary.Schema)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		tables = append(tables, n)
	}
	require.NoError(t, rows.Err())
	require.Contains(t, tables, canary.Schema+".user_scores", "the canary schema must survive")
	require.Contains(t, tables, schema+`.outbox"; DROP TABLE score_events; --`, "the outbox table name must be used verbatim")
	var canaryRows int
	require.NoError(t, canary.Pool.QueryRow(ctx, `SELECT count(*) FROM user_scores`).Scan(&canaryRows))
	require.Zero(t, canaryRows, "nothing may be written to the canary tables")
	summary(t, "security", "hostile-identifiers", "users", len(hostileUsers), "tables", len(tables), "injected", 0)
}

// TestHashSlotsCannotBeMoved checks on a real Redis Cluster that no board
// name or user id changes which slot a board's keys hash to: every key of
// a board has the slot projection.KeySlot computes and CLUSTER KEYSLOT
// confirms, user ids never reach key names, and the whole board works
// (the gate's multi-key scripts would fail with CROSSSLOT otherwise).
func TestHashSlotsCannotBeMoved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	client := cluster.Client(t)
	pg := testenv.Postgres(t)
	prefix := cluster.Prefix(t)
	names := []string{"{a}", "}{", "a{b}c", "{}", "x:y", "%", "%7B", "weekly", "{weekly}"}
	slots := map[int]string{}
	checkedKeys := 0
	for i, name := range names {
		bb := newBoard(t, pg.Pool, pg.Schema, client, prefix, name)
		ks := bb.board.Keyspace()
		want := ks.Slot(projection.Target{Kind: projection.KindSortedSet, Name: name})
		for _, key := range []string{
			bb.board.SortedSetKey(),
			ks.VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: name, Member: hostileUsers[0]}),
			ks.RebuildMarkerKey(name, projection.KindSortedSet),
			ks.ShadowValueKey(name, projection.KindSortedSet),
			ks.ShadowVersionKey(name, projection.KindSortedSet),
			ks.RebuildCopyKey(name, projection.KindSortedSet),
		} {
			got, err := client.ClusterKeySlot(ctx, key).Result()
			require.NoError(t, err)
			require.Equal(t, int64(want), got, "CLUSTER KEYSLOT %q (board %q)", key, name)
			require.Equal(t, want, projection.KeySlot(key))
			checkedKeys++
		}
		for _, u := range hostileUsers {
			require.Equal(t, want, ks.Slot(projection.Target{Kind: projection.KindSortedSet, Name: name, Member: u}),
				"user %q moved board %q", u, name)
		}
		if other, dup := slots[want]; dup {
			t.Logf("boards %q and %q share slot %d (allowed: different keys, same slot)", other, name, want)
		}
		slots[want] = name
		if i < 3 { // the full round trip on a few boards keeps the test short
			exercise(t, bb, hostileUsers)
		}
	}
	// A key prefix is configuration, not data: one that would become the
	// hash tag is refused by every package that takes one.
	for _, bad := range []string{"{", "}", "a{b}:", "pre{fix}"} {
		_, err := leaderboard.New(pg.Pool, client, &leaderboard.Config{Name: "n", Schema: pg.Schema, KeyPrefix: bad})
		require.Error(t, err, "leaderboard KeyPrefix %q", bad)
		_, err = projection.NewKeyspace(bad)
		require.Error(t, err, "projection prefix %q", bad)
		_, err = projection.NewRedisProjector(client, projection.HashMapper("h"), &projection.Config{Prefix: bad})
		require.Error(t, err, "projector prefix %q", bad)
		_, err = versioncache.New[string](client, &versioncache.Config{Prefix: bad})
		require.Error(t, err, "versioncache prefix %q", bad)
	}
	summary(t, "security", "hash-slots", "boards", len(names), "keys_checked", checkedKeys,
		"users", len(hostileUsers), "slot_moved", 0)
}

// selfSignedCA returns a CA and a server certificate for 127.0.0.1 and
// localhost, as PEM files in dir: ca.crt, server.crt, server.key.
func selfSignedCA(t *testing.T, dir string, owner int) (caFile, certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "verity faults CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	caCert, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	srvTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	require.NoError(t, err)
	write := func(name, typ string, der []byte, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode))
		if owner >= 0 {
			require.NoError(t, os.Chown(p, owner, -1))
		}
		return p
	}
	return write("ca.crt", "CERTIFICATE", caDER, 0o644), write("server.crt", "CERTIFICATE", srvDER, 0o644),
		write("server.key", "EC PRIVATE KEY", keyDER, 0o600)
}

// TestRedisAuthACLAndTLS runs a board end to end through Redis clients
// configured with a password, an ACL user restricted to the board's key
// prefix, and TLS: the library takes the caller's client and must pass
// all of it through untouched.
func TestRedisAuthACLAndTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const password = "s3cret"
	dir := t.TempDir()
	caFile, certFile, keyFile := selfSignedCA(t, dir, -1)
	tlsPort, err := services.FreePort()
	require.NoError(t, err)
	rs := testenv.StartRedis(t, "--requirepass", password,
		"--tls-port", strconv.Itoa(tlsPort), "--tls-cert-file", certFile, "--tls-key-file", keyFile,
		"--tls-ca-cert-file", caFile, "--tls-auth-clients", "no")
	// refused checks that a board whose client Redis refuses keeps its
	// outbox row (nothing lost) and reports Redis's refusal on reads.
	refused := func(t *testing.T, bb *boardBundle, reply string) {
		_, err := bb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "u", Delta: 1})
		require.NoError(t, err, "submits only touch PostgreSQL")
		_, err = bb.worker(t, "refused").RunOnce(ctx)
		require.NoError(t, err, "a handler failure is the relay's to retry, not RunOnce's error")
		st, err := bb.stats(ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), st.Pending, "the refused row must stay in the outbox")
		_, err = bb.board.Top(ctx, 10)
		require.ErrorContains(t, err, reply)
	}

	t.Run("NoPasswordIsRefused", func(t *testing.T) {
		pg := testenv.Postgres(t)
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
		defer rdb.Close()
		refused(t, newBoard(t, pg.Pool, pg.Schema, rdb, "verity:faults:noauth:", "noauth"), "NOAUTH")
	})
	t.Run("Password", func(t *testing.T) {
		pg := testenv.Postgres(t)
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), Password: password})
		defer rdb.Close()
		exercise(t, newBoard(t, pg.Pool, pg.Schema, rdb, "verity:faults:auth:", "auth"), hostileUsers[:4])
	})
	t.Run("ACLUser", func(t *testing.T) {
		pg := testenv.Postgres(t)
		admin := redis.NewClient(&redis.Options{Addr: rs.Addr(), Password: password})
		defer admin.Close()
		require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "verity", "on", ">acl-pass", "~verity:faults:acl:*", "+@all").Err())
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), Username: "verity", Password: "acl-pass"})
		defer rdb.Close()
		exercise(t, newBoard(t, pg.Pool, pg.Schema, rdb, "verity:faults:acl:", "acl"), hostileUsers[:4])
		// Outside its key pattern the same user is refused: the ACL is in force.
		denied := testenv.Postgres(t)
		refused(t, newBoard(t, denied.Pool, denied.Schema, rdb, "verity:faults:elsewhere:", "acl-denied"), "NOPERM")
	})
	t.Run("TLS", func(t *testing.T) {
		pg := testenv.Postgres(t)
		caPEM, err := os.ReadFile(caFile)
		require.NoError(t, err)
		roots := x509.NewCertPool()
		require.True(t, roots.AppendCertsFromPEM(caPEM))
		tlsAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(tlsPort))
		rdb := redis.NewClient(&redis.Options{Addr: tlsAddr, Password: password,
			TLSConfig: &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}})
		defer rdb.Close()
		exercise(t, newBoard(t, pg.Pool, pg.Schema, rdb, "verity:faults:tls:", "tls"), hostileUsers[:4])
		// A plaintext client cannot talk to the TLS port: the board above really used TLS.
		plain := redis.NewClient(&redis.Options{Addr: tlsAddr, Password: password, DialTimeout: time.Second, ReadTimeout: time.Second, MaxRetries: -1})
		defer plain.Close()
		require.Error(t, plain.Ping(ctx).Err())
	})
	summary(t, "security", "redis-auth-acl-tls", "auth", "ok", "acl", "ok", "tls", "ok")
}

// TestPostgresTLS turns SSL on in a private PostgreSQL with a self-signed
// certificate and runs a board through a pool that verifies it
// (sslmode=verify-full): the connections the library uses are the caller's,
// TLS included.
func TestPostgresTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartPostgres(t)
	admin := srv.Pool(t)
	var dataDir string
	require.NoError(t, admin.QueryRow(ctx, `SHOW data_directory`).Scan(&dataDir))
	st, err := os.Stat(dataDir)
	require.NoError(t, err)
	owner := int(st.Sys().(*syscall.Stat_t).Uid)
	caFile, _, _ := selfSignedCA(t, dataDir, owner) // server.crt and server.key are PostgreSQL's defaults
	_, err = admin.Exec(ctx, `ALTER SYSTEM SET ssl = on`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)

	u, err := url.Parse(srv.ConnString())
	require.NoError(t, err)
	q := u.Query()
	q.Set("sslmode", "verify-full")
	q.Set("sslrootcert", caFile)
	q.Set("application_name", "verity-faults-tls")
	u.RawQuery = q.Encode()
	var pool *pgxpool.Pool
	require.Eventually(t, func() bool { // the reload is asynchronous
		p, err := pgxpool.New(ctx, u.String())
		if err == nil && p.Ping(ctx) == nil {
			pool = p
			return true
		}
		if p != nil {
			p.Close()
		}
		return false
	}, 10*time.Second, 50*time.Millisecond)
	t.Cleanup(pool.Close)
	rd := testenv.Redis(t)
	exercise(t, newBoard(t, pool, "faults_tls", rd.Client, rd.Prefix, "tls"), hostileUsers[:4])

	var plain, encrypted int
	require.NoError(t, admin.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
		FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
		WHERE a.application_name = 'verity-faults-tls'`).Scan(&plain, &encrypted))
	require.Zero(t, plain, "connections of the TLS pool without TLS")
	require.Positive(t, encrypted)
	summary(t, "security", "postgres-tls", "tls_connections", encrypted, "plaintext_connections", plain)
}

// syncBuffer is a bytes.Buffer safe for the concurrent writes of a logger.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestNoCredentialsInLogsOrErrors runs a board, its workers and its
// reconciler with debug logging, through connections that carry a
// PostgreSQL password and a Redis password, then forces failures on both
// sides (Redis killed, PostgreSQL stopped, a wrong Redis password) and
// checks that neither secret appears in any log line or error string.
func TestNoCredentialsInLogsOrErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pgSecret := "pg-S3cret-" + services.RandomSuffix(8)
	redisSecret := "redis-S3cret-" + services.RandomSuffix(8)
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))

	srv := testenv.StartPostgres(t)
	u, err := url.Parse(srv.ConnString())
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), pgSecret) // trust auth ignores it; it is still in every config
	pool, err := pgxpool.New(ctx, u.String())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	rs := testenv.StartRedis(t, "--requirepass", redisSecret)
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), Password: redisSecret, MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: time.Second})
	t.Cleanup(func() { _ = rdb.Close() })
	bb := newBoard(t, pool, "faults_secrets", rdb, "verity:faults:secrets:", "secrets",
		func(c *leaderboard.Config) { c.Logger = logger })

	var errs []error
	note := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	workerCfg := faultRelayConfig("secrets")
	workerCfg.Logger = logger
	worker, err := bb.board.Worker(&leaderboard.WorkerConfig{Relay: workerCfg})
	require.NoError(t, err)
	rec, err := bb.board.Reconciler(&reconcile.Config{Logger: logger})
	require.NoError(t, err)
	submit := func() error {
		_, err := bb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "u", Delta: 1})
		return err
	}
	run := func() {
		note(submit())
		_, err := worker.Drain(ctx)
		note(err)
		_, err = bb.board.Top(ctx, 10)
		note(err)
		_, err = rec.Run(ctx, reconcile.RunOptions{})
		note(err)
	}
	run() // healthy, with debug logs
	runCtx, stopRun := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- worker.Run(runCtx) }()

	// Redis killed: relays, reads and reconcile fail and log.
	require.NoError(t, rs.Kill())
	run()
	time.Sleep(300 * time.Millisecond) // let the running relay fail and log a few times
	require.NoError(t, rs.Start())
	// A wrong Redis password.
	wrong := redis.NewClient(&redis.Options{Addr: rs.Addr(), Password: "not-" + redisSecret})
	defer wrong.Close()
	wrongBoard, err := leaderboard.New(pool, wrong, &leaderboard.Config{Name: "secrets", Schema: "faults_secrets", KeyPrefix: "verity:faults:secrets:", Logger: logger})
	require.NoError(t, err)
	_, err = wrongBoard.Top(ctx, 10)
	note(err)
	// PostgreSQL stopped: submits, relays and reconcile fail and log.
	require.NoError(t, srv.Stop())
	run()
	time.Sleep(300 * time.Millisecond)
	stopRun()
	note(<-runDone)
	require.NoError(t, srv.Start())

	require.GreaterOrEqual(t, len(errs), 6, "the failures must have produced errors")
	for _, err := range errs {
		for _, text := range []string{err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", errors.Unwrap(err))} {
			require.NotContains(t, text, pgSecret)
			require.NotContains(t, text, redisSecret)
		}
	}
	out := logs.String()
	require.NotEmpty(t, out, "debug logging produced nothing to check")
	require.NotContains(t, out, pgSecret)
	require.NotContains(t, out, redisSecret)
	summary(t, "security", "no-credentials-in-logs-or-errors", "errors_checked", len(errs),
		"log_bytes_checked", len(out), "leaks", 0)
}
