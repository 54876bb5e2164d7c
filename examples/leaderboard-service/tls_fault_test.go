package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// TestSubmitWithRefusedServerCertificateIsAFault: a pool whose TLS
// settings refuse the server's certificate (here: only a CA the test just
// made is trusted) can never connect until an operator fixes it, as a
// refused password cannot: 500, not 503 with "retry with the same
// Idempotency-Key" for ever.
func TestSubmitWithRefusedServerCertificateIsAFault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: rd.Prefix}
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))

	ca := unrelatedCA(t)
	// verify-full is checked by crypto/tls, verify-ca by pgx: their errors
	// differ.
	for _, mode := range []string{"verify-full", "verify-ca"} {
		t.Run(mode, func(t *testing.T) {
			pcfg, err := pgxpool.ParseConfig(pg.ConnString + "&sslmode=" + mode + "&sslrootcert=" + ca)
			require.NoError(t, err)
			pool, err := pgxpool.NewWithConfig(ctx, pcfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			board, err := leaderboard.New(pool, rd.Client, cfg)
			require.NoError(t, err)
			// The premise: the shared server offers TLS, and its
			// certificate is refused.
			_, err = board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
			var (
				authority x509.UnknownAuthorityError
				hostname  x509.HostnameError // the server's certificate names no 127.0.0.1
			)
			if !errors.As(err, &authority) && !errors.As(err, &hostname) {
				testenv.Unavailable(t, "the shared PostgreSQL does not offer TLS with a certificate to refuse: %v", err)
			}

			svc, err := NewService(pool, rd.Client, board, ServiceConfig{})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, svc.Close()) })
			tb := &testBundle{pg: pg, rd: rd, board: board, svc: svc, srv: newServer(t, svc)}
			res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`)
			require.Equal(t, http.StatusInternalServerError, res.status, "%s", res.body)
			require.Empty(t, res.header.Get("Retry-After"))
		})
	}
}

// unrelatedCA writes a fresh self-signed CA certificate, which signed no
// server's certificate, and returns its file.
func unrelatedCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "verity test CA that signed nothing"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "ca.crt")
	require.NoError(t, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	return path
}
