package services

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// TestWithSearchPathKeepsWhatPgxReads: WithSearchPath keeps the connection
// pgx reads from a string it accepts and adds the search_path. pgx (as
// libpq) ends a URL's userinfo at the first '@' before a '/', so a password
// may hold '#' or '?' unencoded; net/url read those as a fragment or a
// query, and the result either did not parse (and testenv printed it,
// password and all) or put the search_path inside the password.
func TestWithSearchPathKeepsWhatPgxReads(t *testing.T) {
	t.Parallel()
	for _, base := range []string{
		"postgres://postgres:Zq9Secret#x@127.0.0.1:5432/test",
		"postgres://postgres:12345#x@127.0.0.1:5432/test",
		"postgres://postgres:Zq9?Secret@127.0.0.1:5432/test",
		"postgresql://postgres:pw@127.0.0.1:5432/test?sslmode=disable",
		"postgres://postgres@127.0.0.1:5432/test?search_path=old",
		"host=127.0.0.1 user=postgres password=pw dbname=test",
		"postgres://postgres@127.0.0.1:5432/test?",
		"postgres://postgres@127.0.0.1:5432/test?sslmode=disable&",
		"postgres://postgres@127.0.0.1:5432?",
	} {
		want, err := pgxpool.ParseConfig(base)
		require.NoError(t, err, base)
		got, err := pgxpool.ParseConfig(WithSearchPath(base, "t_s"))
		require.NoError(t, err, "%q: WithSearchPath's result does not parse", base)
		w, g := want.ConnConfig, got.ConnConfig
		require.Equal(t, []any{w.Host, w.Port, w.User, w.Password, w.Database}, []any{g.Host, g.Port, g.User, g.Password, g.Database}, base)
		require.Equal(t, "t_s", g.RuntimeParams["search_path"], base)
	}
}

// TestHidePostgresConnStringHidesEveryPiece: a keyword/value string that
// pgx cannot parse is not shown, nor the word pgx took for a keyword
// without '=' (after an unquoted password holding a space, the rest of the
// password); the error stays a *pgconn.ParseConfigError.
func TestHidePostgresConnStringHidesEveryPiece(t *testing.T) {
	t.Parallel()
	const secret = "Zq9Secret"
	for _, s := range []string{
		"host=127.0.0.1 password = " + secret + " port=zz",
		"host=127.0.0.1 password= " + secret + " port=zz",
		`host=127.0.0.1 password=x\ ` + secret + " port=zz",
		"host=127.0.0.1 sslpassword = " + secret + " port=zz",
		"host=127.0.0.1 password=correct " + secret + " user=u",
		"host=127.0.0.1 password = correct " + secret + " sslmode=disable",
		"password=correct " + secret,
	} {
		_, err := pgxpool.ParseConfig(s)
		require.Error(t, err, s)
		err = HidePostgresConnString(err)
		require.NotContains(t, err.Error(), secret, s)
		require.Contains(t, err.Error(), hiddenConnString, s)
		require.ErrorAs(t, err, new(*pgconn.ParseConfigError), s)
	}
	_, err := pgxpool.ParseConfig("postgres://bob:" + secret + "@127.0.0.1:zz/db")
	require.ErrorContains(t, HidePostgresConnString(err), "postgres://bob:xxxxx@127.0.0.1:zz/db", "a URL keeps pgx's masking")
}
