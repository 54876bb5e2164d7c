package outbox_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestClaimSkipsAPartitionLeasedAfterItsSnapshot: a claim's snapshot shows
// a partition free, and another claim leases that partition and commits
// before this claim locks it. The lock then reads the partition's new
// version, and the claim must see the live lease there and skip it: two
// batches holding one partition would hand its rows to two relays at once.
// Both of the lease statement's locking steps check the lease again for
// that reason: "free" (the partitions of "due") and "more" (those after
// it, when other claims had locked all of "due").
//
// The interleaving is forced, not hoped for. The claim runs under an
// unprivileged role, and a row-level security policy on the lease table,
// which only that role obeys, waits for an advisory lock the test holds.
// So the claim stops at its first read of the lease table, after its
// statement took its snapshot; the test commits the other lease and lets
// it go on. TestRelayConcurrency reaches the "free" case only when its
// relays happen to collide there (about three runs in four).
func TestClaimSkipsAPartitionLeasedAfterItsSnapshot(t *testing.T) {
	t.Parallel()

	t.Run("Free", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		b.gatedClaim(t).requireSkipsLateLease(t, b.rows(t)[0].ID/256%64)
	})

	t.Run("More", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 9)
		b.claimOrder(t, 0, 1, 2, 3, 4, 5, 6, 7, 8)
		claim := b.gatedClaim(t) // before the locks: the policy's ALTER TABLE would wait for them
		// Claims under way hold all of "due" (the first 8 partitions with
		// rows), so the claim looks further and finds only partition 8.
		b.lockPartitionsBelow(t, 8)
		claim.requireSkipsLateLease(t, 8)
	})
}

// gatedClaim is a relay whose claims wait at their first read of the lease
// table while the test holds an advisory lock.
type gatedClaim struct {
	b     *testBundle
	rp    *setRolePool
	relay *outbox.Relay
	key   int64 // the advisory lock
}

// gatedClaim builds a relay on a pool of an unprivileged role, and a
// row-level security policy on the lease table, obeyed by that role only
// (not by the test's superuser), that waits while another session holds
// advisory lock key.
func (b *testBundle) gatedClaim(t *testing.T) *gatedClaim {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	g := &gatedClaim{b: b, rp: newSetRolePool(t, b), key: rand.Int64()}
	g.relay = b.relay(t, g.rp.pool, &recorder{}, outbox.RelayConfig{Name: "gated"})
	gate := pgx.Identifier{b.cfg.Schema, "lease_read_gate"}.Sanitize()
	_, err := b.pool.Exec(ctx, `CREATE FUNCTION `+gate+`(key bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock_shared(key);
    PERFORM pg_advisory_unlock_shared(key);
    RETURN true;
END
$$;
ALTER TABLE `+b.leasesTable()+` ENABLE ROW LEVEL SECURITY;
CREATE POLICY "gate" ON `+b.leasesTable()+` USING (`+gate+`(`+strconv.FormatInt(g.key, 10)+`))`)
	require.NoError(t, err)
	return g
}

// requireSkipsLateLease starts a claim, leases part to another token once
// the claim has its snapshot, and requires that the claim takes nothing
// (the rows are in part, or in partitions locked elsewhere) and leaves
// part's lease alone.
func (g *gatedClaim) requireSkipsLateLease(t *testing.T, part int64) {
	t.Helper()
	b := g.b
	ctx := context.Background()
	holder, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, g.key)
	require.NoError(t, err)

	type claimed struct {
		batch []outbox.Record
		err   error
	}
	done := make(chan claimed, 1)
	go func() {
		batch, err := g.relay.ClaimOnly(ctx)
		done <- claimed{batch, err}
	}()
	require.Eventually(t, func() bool { return g.rp.waitingForAdvisoryLock(b) }, 10*time.Second, 5*time.Millisecond,
		"the claim waits at its first read of the lease table")

	other := uuid.New()
	tag, err := b.pool.Exec(ctx, `UPDATE `+b.leasesTable()+` SET owner = $1, leased_until = now() + interval '1 hour' WHERE part = $2`,
		other, part)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, g.key)
	require.NoError(t, err)

	var got claimed
	select {
	case got = <-done:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the claim did not return")
	}
	require.NoError(t, got.err)
	require.Empty(t, got.batch, "the claim may take no partition with rows")
	var owner uuid.UUID
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT owner FROM `+b.leasesTable()+` WHERE part = $1`, part).Scan(&owner))
	require.Equal(t, other, owner, "the other claim keeps its lease")
}
