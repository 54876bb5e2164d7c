package services

import (
	"context"
	"fmt"
	"net/url"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// deadURLs point at a port nothing listens on, so "local" does not answer.
func deadURLs(t *testing.T) (pg, rd string) {
	t.Helper()
	port, err := FreePort()
	require.NoError(t, err)
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?connect_timeout=1", port),
		fmt.Sprintf("redis://127.0.0.1:%d/0", port)
}

// env is an environment holding only vars.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestResolveOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("EnvWins", func(t *testing.T) {
		t.Parallel()
		rs, err := StartRedis(ctx, "")
		require.NoError(t, err)
		t.Cleanup(rs.Close)
		pg, _ := deadURLs(t)
		// Postgres falls through to a private server because local is dead.
		ep, err := Resolve(ctx, Options{
			Getenv:           env(map[string]string{"REDIS_URL": rs.URL()}),
			LocalPostgresURL: pg, LocalRedisURL: DefaultRedisURL,
		})
		require.NoError(t, err)
		t.Cleanup(ep.Close)
		require.Equal(t, OriginEnv, ep.RedisOrigin)
		require.Equal(t, rs.URL(), ep.RedisURL)
		require.Equal(t, OriginPrivate, ep.PostgresOrigin)
		require.NoError(t, pingPostgres(ctx, ep.PostgresURL))
	})

	// A user with exactly the commands the README's "Redis permissions"
	// lists, which has no PING: the server answers NOPERM, so it answers.
	// REDIS_URL was reported "set but does not answer", and the service
	// refused to start with the README's ACL user unless given the flag.
	t.Run("EnvUserWithoutPingAnswers", func(t *testing.T) {
		t.Parallel()
		rs, err := StartRedis(ctx, "")
		require.NoError(t, err)
		t.Cleanup(rs.Close)
		opt, err := ParseRedisURL(rs.URL())
		require.NoError(t, err)
		admin := redis.NewClient(opt)
		t.Cleanup(func() { _ = admin.Close() })
		require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "svc", "reset", "on", ">pw", "~app:*", "-@all", "+get", "+evalsha").Err())
		opt.Username, opt.Password = "svc", "pw"
		restricted := redis.NewClient(opt)
		t.Cleanup(func() { _ = restricted.Close() })
		require.ErrorContains(t, restricted.Ping(ctx).Err(), "NOPERM", "the user may not PING")
		u := fmt.Sprintf("redis://svc:pw@%s/0", opt.Addr)
		ep, err := Resolve(ctx, Options{Getenv: env(map[string]string{"REDIS_URL": u}), SkipPostgres: true})
		require.NoError(t, err)
		t.Cleanup(ep.Close)
		require.Equal(t, OriginEnv, ep.RedisOrigin)
		require.Equal(t, u, ep.RedisURL)

		// No answer worth using: a wrong password, or a NOPERM for a
		// command go-redis sends on every connection it opens (SELECT for
		// a database other than 0, CLIENT SETNAME for client_name=), on
		// which every command would fail.
		for _, bad := range []string{"redis://svc:nope@%s/0", "redis://svc:pw@%s/1", "redis://svc:pw@%s/0?client_name=lb"} {
			_, err = Resolve(ctx, Options{Getenv: env(map[string]string{"REDIS_URL": fmt.Sprintf(bad, opt.Addr)}), SkipPostgres: true})
			require.ErrorContains(t, err, "REDIS_URL is set but does not answer", bad)
		}

		// The local default must answer in full: with a default user that
		// may not PING, a private server is started instead.
		require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "default", "-ping").Err())
		ep, err = Resolve(ctx, Options{Getenv: env(nil), LocalRedisURL: rs.URL(), SkipPostgres: true})
		require.NoError(t, err)
		t.Cleanup(ep.Close)
		require.Equal(t, OriginPrivate, ep.RedisOrigin)
	})

	t.Run("EnvSetButDeadIsAnError", func(t *testing.T) {
		_, rd := deadURLs(t)
		t.Parallel()
		_, err := Resolve(ctx, Options{Getenv: env(map[string]string{"REDIS_URL": rd})})
		require.ErrorContains(t, err, "REDIS_URL is set but does not answer")
	})

	// DATABASE_URL that pgx cannot parse: the error does not show a
	// keyword/value string pgx's masking would leave the password in.
	t.Run("EnvUnparsableHidesKeywordValueString", func(t *testing.T) {
		t.Parallel()
		_, err := Resolve(ctx, Options{Getenv: env(map[string]string{"DATABASE_URL": "host=127.0.0.1 password = Qz9Wk7 port=zz"}), SkipRedis: true})
		require.ErrorContains(t, err, "DATABASE_URL is set but does not answer")
		require.ErrorContains(t, err, hiddenConnString)
		require.NotContains(t, err.Error(), "Qz9Wk7")
	})

	t.Run("SkippedServersAreLeftOut", func(t *testing.T) {
		pg, rd := deadURLs(t)
		t.Parallel()
		// Both variables point at nothing and nothing answers locally:
		// only a server that is not skipped is looked for at all.
		dead := env(map[string]string{"DATABASE_URL": pg, "REDIS_URL": rd})
		ep, err := Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipPostgres: true, SkipRedis: true})
		require.NoError(t, err)
		require.Equal(t, Endpoints{}, *ep)

		_, err = Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipPostgres: true})
		require.ErrorContains(t, err, "REDIS_URL is set but does not answer")
		_, err = Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipRedis: true})
		require.ErrorContains(t, err, "DATABASE_URL is set but does not answer")
	})

	t.Run("LocalThenPrivate", func(t *testing.T) {
		t.Parallel()
		pg, rd := deadURLs(t)
		ep, err := Resolve(ctx, Options{
			Getenv:           env(nil),
			LocalPostgresURL: pg, LocalRedisURL: rd,
		})
		require.NoError(t, err)
		require.Equal(t, OriginPrivate, ep.PostgresOrigin)
		require.Equal(t, OriginPrivate, ep.RedisOrigin)
		require.NoError(t, pingRedis(ctx, ep.RedisURL))
		ep.Close()
		require.Error(t, pingRedis(ctx, ep.RedisURL), "Close stops the private servers")
	})
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	require.Equal(t, "postgres://app:xxxxx@db:5432/x", redactURL("postgres://app:s3cret@db:5432/x"))
	require.Equal(t, "redis://127.0.0.1:6379/0", redactURL("redis://127.0.0.1:6379/0"))
	require.Equal(t, "redis:/bob:xxxxx@127.0.0.1:6379/0", redactURL("redis:/bob:s3cret@127.0.0.1:6379/0"), "one slash after the scheme")
	require.Equal(t, hiddenURL, redactURL("bob@x://y"), "an '@' with no scheme to start from")
	require.Equal(t, hiddenURL, redactURL("bob:s3cret@127.0.0.1:6379"), "no slash after the scheme")
}

// TestRedisURLErrorsHoldNoPassword: go-redis reports a URL it cannot parse
// with net/url's error, which quotes the URL whole, and a password with a
// reserved character comes back in pieces (as the port, or in the path);
// the services parsers, and Resolve through them, report neither.
func TestRedisURLErrorsHoldNoPassword(t *testing.T) {
	t.Parallel()
	// The password is Qz9 and Wk7 around whatever makes the URL fail, so a
	// piece of it shows as well as the whole.
	passwordAtFault := errPasswordNotInURLSyntax.Error()
	for _, tc := range []struct {
		name, url, want string
		singleOnly      bool // ParseClusterURL ignores the path
	}{
		{"BadPort", "redis://bob:Qz9Wk7@127.0.0.1:port/0", `parse "redis://bob:xxxxx@127.0.0.1:port/0": invalid port ":port" after host`, false},
		{"BadEscapeInPath", "redis://bob:Qz9Wk7@127.0.0.1:6379/0%zz", `parse "redis://bob:xxxxx@127.0.0.1:6379/0%zz": invalid URL escape "%zz"`, false},
		{"SlashInPassword", "redis://bob:Qz9/Wk7@127.0.0.1:6379/0", passwordAtFault, false},
		{"HashInPassword", "redis://bob:Qz9#Wk7@127.0.0.1:6379/0", passwordAtFault, false},
		{"QuestionMarkInPassword", "redis://bob:Qz9?Wk7@127.0.0.1:6379/0", passwordAtFault, false},
		{"BadEscapeInPassword", "redis://bob:Qz9%zzWk7@127.0.0.1:6379/0", passwordAtFault, false},
		{"SpaceInPassword", "redis://bob:Qz9 Wk7@127.0.0.1:6379/0", passwordAtFault, false},
		{"PasswordOnly", "redis://:Qz9/Wk7@127.0.0.1:6379/0", passwordAtFault, false},
		// A port-like start leaves the authority valid: the rest of the
		// password lands in the path, which go-redis quotes.
		{"DigitsThenSlash", "redis://bob:123/Qz9Wk7@127.0.0.1:6379/0", passwordAtFault, true},
		// With no "scheme:/" the userinfo cannot be found: no part is shown.
		{"NoScheme", "bob:Qz9%zzWk7@127.0.0.1:6379/0", hiddenURL, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			errs := map[string]error{}
			_, errs["ParseRedisURL"] = ParseRedisURL(tc.url)
			if !tc.singleOnly {
				_, errs["ParseRedisClusterURL"] = ParseRedisClusterURL(tc.url)
			}
			_, errs["Resolve"] = Resolve(context.Background(), Options{
				Getenv: env(map[string]string{"REDIS_URL": tc.url}), SkipPostgres: true,
			})
			for name, err := range errs {
				require.Error(t, err, name)
				require.ErrorContains(t, err, tc.want, name)
				require.ErrorAs(t, err, new(*url.Error), name)
				for _, piece := range []string{"Qz9", "Wk7"} {
					require.NotContains(t, err.Error(), piece, "%s quotes the password", name)
				}
			}
		})
	}

	// "redis:/" is read as a path, which net/url (the bad escape) or
	// go-redis quotes.
	t.Run("SingleSlash", func(t *testing.T) {
		t.Parallel()
		for _, bad := range []string{"redis:/bob:Qz9%zzWk7@127.0.0.1:6379/0", "redis:/bob:Qz9Wk7@127.0.0.1:6379/0"} {
			_, err := ParseRedisURL(bad)
			require.ErrorContains(t, err, "invalid URL path: /bob:xxxxx@127.0.0.1:6379/0", bad)
			for _, piece := range []string{"Qz9", "Wk7"} {
				require.NotContains(t, err.Error(), piece, bad)
			}
		}
	})

	// An '@' in the query of a URL with no password is no userinfo: the
	// error is go-redis's own, naming the real mistake, not the password.
	t.Run("AtInQueryWithoutPassword", func(t *testing.T) {
		t.Parallel()
		_, err := ParseRedisURL("redis://127.0.0.1:6379/0?client_name=svc@prod&dial_timeout=abc")
		require.ErrorContains(t, err, "invalid dial_timeout duration")
		require.NotContains(t, err.Error(), passwordAtFault)
	})

	t.Run("ValidURLParsesAsGiven", func(t *testing.T) {
		t.Parallel()
		opt, err := ParseRedisURL("redis://bob:Qz9%2FWk7@127.0.0.1:6379/2")
		require.NoError(t, err)
		require.Equal(t, "Qz9/Wk7", opt.Password)
		require.Equal(t, 2, opt.DB)
		copt, err := ParseRedisClusterURL("redis://bob:Qz9%2FWk7@127.0.0.1:7001?addr=127.0.0.1:7002")
		require.NoError(t, err)
		require.Equal(t, "Qz9/Wk7", copt.Password)
		require.Equal(t, []string{"127.0.0.1:7001", "127.0.0.1:7002"}, copt.Addrs)
	})
}
