package leaderboard

import (
	"context"
	_ "embed"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/reconcile"
)

var (
	//go:embed verified.lua
	verifiedLua    string
	verifiedScript = redis.NewScript(verifiedLua)

	//go:embed verify_abandon.lua
	verifyAbandonLua    string
	verifyAbandonScript = redis.NewScript(verifyAbandonLua)
)

// verifyAbandonTimeout bounds the deletion of a pass's marker after a Verify
// that records nothing, whose own ctx may have ended.
const verifyAbandonTimeout = 5 * time.Second

// Verify runs a full reconcile pass over the board and, when the pass
// repaired every missing, stale and corrupt entry it found (a repair that
// raced a newer write counts: the entry is there) and Redis kept the board's
// keys throughout, records in Redis that the projection is complete. With
// Config.RequireVerifiedProjection, reads report Lag -1 and Unverified until
// that record exists; a Redis that loses its data loses the record too.
// verified tells whether it was recorded; when it was not, run Verify again
// (the report says what stood in the way).
//
// cfg configures the pass's Reconciler as for Board.Reconciler; its Policy
// must repair (the default) missing, stale and corrupt entries, or nothing
// can be recorded.
//
// While the pass runs, Redis holds its marker (the key SortedSetKey() +
// "~verifying"); a Verify that records nothing, an error included,
// deletes it before returning. A process that dies during a pass, or a
// Redis that fails that deletion, leaves it until the board's next Verify,
// which replaces it; it never stands for a verified projection.
func (b *Board) Verify(ctx context.Context, cfg *reconcile.Config) (report *reconcile.Report, verified bool, err error) {
	rec, err := b.Reconciler(cfg)
	if err != nil {
		return nil, false, err
	}
	token := uuid.NewString()
	if err := b.rdb.Set(ctx, b.verifyingKey, token, 0).Err(); err != nil {
		return nil, false, fmt.Errorf("leaderboard: verify: %w", err)
	}
	defer func() {
		if !verified {
			b.abandonVerify(ctx, token)
		}
	}()
	report, err = rec.Run(ctx, reconcile.RunOptions{})
	if err != nil {
		return report, false, err
	}
	policy := cfg.WithDefaults().Policy
	for _, c := range []reconcile.Class{reconcile.ClassMissing, reconcile.ClassStale, reconcile.ClassCorrupt} {
		if report.Counts[c] > 0 && policy.For(c) != reconcile.ActionRepair {
			return report, false, nil
		}
	}
	if report.Uncertain > 0 || report.Results[reconcile.ResultVetoed] > 0 || report.Results[reconcile.ResultNotAttempted] > 0 {
		return report, false, nil
	}
	n, err := verifiedScript.Run(ctx, b.rdb, []string{b.verifyingKey, b.verifiedKey},
		token, time.Now().UTC().Format(time.RFC3339Nano)).Int()
	if err != nil {
		return report, false, fmt.Errorf("leaderboard: verify: recording the result: %w", err)
	}
	if n == 1 {
		// Make the last measurement due, so that the next read measures
		// again (one read: the others keep the previous measurement
		// meanwhile, as always).
		b.lagMu.Lock()
		if !b.lagProbe.at.IsZero() {
			b.lagProbe.at = b.lagProbe.at.Add(-b.cfg.LagProbeInterval)
		}
		b.lagMu.Unlock()
	}
	return report, n == 1, nil
}

// abandonVerify deletes the marker of the pass token if it is still there,
// also after ctx has ended. A failure only leaves the marker to the next
// Verify, so it is logged, not returned.
func (b *Board) abandonVerify(ctx context.Context, token string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verifyAbandonTimeout)
	defer cancel()
	if err := verifyAbandonScript.Run(ctx, b.rdb, []string{b.verifyingKey}, token).Err(); err != nil {
		b.cfg.Logger.Warn("leaderboard: verify: deleting the pass's marker failed", "board", b.cfg.Name, "error", err)
	}
}

// projectionVerified reports whether Redis holds Verify's record that the
// projection is complete, read on the master.
func (b *Board) projectionVerified(ctx context.Context) (bool, error) {
	var cmd *redis.IntCmd
	err := b.onMaster(ctx, b.verifiedKey, func(p redis.Pipeliner) { cmd = p.Exists(ctx, b.verifiedKey) })
	if err != nil {
		return false, err
	}
	return cmd.Val() == 1, nil
}
