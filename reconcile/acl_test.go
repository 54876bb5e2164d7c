package reconcile

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// documentWriterCommands is the README's "Redis permissions" for a process
// that reconciles documents: the leaderboard writer's list, with scan and
// strlen besides.
var documentWriterCommands = []string{"evalsha", "eval", "evalsha_ro", "eval_ro", "get", "set", "mget",
	"exists", "del", "unlink", "type", "hget", "hset", "hmget", "hdel",
	"hlen", "hscan", "hincrby", "hrandfield", "zadd", "zrem", "zscore",
	"zmscore", "zrank", "zrange", "zcard", "zcount", "zscan", "rename", "pexpire", "info",
	"scan", "strlen"}

// TestDocumentRepairWithListedCommands runs a document reconciler as a
// Redis user allowed exactly the README's commands: it repairs a missing
// document (through the gate, whose script calls STRLEN, which the list
// used to leave out: NOPERM).
func TestDocumentRepairWithListedCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	acl := []any{"ACL", "SETUSER", "rec", "reset", "on", ">pw", "~doc:*", "-@all"}
	for _, c := range documentWriterCommands {
		acl = append(acl, "+"+c)
	}
	require.NoError(t, srv.Client(t).Do(ctx, acl...).Err())
	limited := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "rec", Password: "pw"})
	t.Cleanup(func() { _ = limited.Close() })

	b := setupWith(t, projection.KindDocument, limited, "doc:")
	b.insert(t, "d1", 1) // in the source, missing from Redis
	report, err := b.reconciler(t, nil).Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, report.Repaired, "report: %+v", report)
}
