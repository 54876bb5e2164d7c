package outbox

import (
	"context"
	"time"

	"github.com/google/uuid"
)

// Backoff exposes the retry delay computation to the external tests.
func (r *Relay) Backoff(attempts int) time.Duration { return r.backoff(attempts) }

// ClaimSQL exposes the two claim statements so a test can inspect their plans.
func (r *Relay) ClaimSQL() (lease, pick string) { return r.leaseSQL, r.pickSQL }

// SettleSQL exposes the settle statement so a test can inspect its plan.
func (r *Relay) SettleSQL() string { return r.settleSQL }

// ClaimOnly claims a batch and never settles it, like a relay process that
// dies while its Handler runs.
func (r *Relay) ClaimOnly(ctx context.Context) ([]Record, error) {
	batch, _, _, err := r.claim(ctx, ctx, uuid.New())
	return batch, err
}

// SetReleaseLockTimeout shortens how long releaseClaim waits for a cut-off
// claim to end. Call it before the relay is used.
func (r *Relay) SetReleaseLockTimeout(d time.Duration) { r.releaseTimeouts.lock = d }

// SetReleaseTimeouts replaces releaseClaim's overall bound, its cancel
// statement's and its wait's cap. Call it before the relay is used.
func (r *Relay) SetReleaseTimeouts(total, cancel, lock time.Duration) {
	r.releaseTimeouts = releaseTimeouts{total: total, cancel: cancel, lock: lock}
}

// SetSettleTimeout replaces the settle's bound once Run is shutting down
// (and its least bound before that). Call it before the relay is used.
func (r *Relay) SetSettleTimeout(d time.Duration) { r.settleTimeout = d }

// Pauses returns the first n pauses of a reconnect pauser capped at ceiling.
func Pauses(ceiling time.Duration, n int) []time.Duration {
	p := newPauser(ceiling)
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = p.next()
	}
	return out
}

// MigrationLockKey is the advisory lock Migrate holds.
const MigrationLockKey = migrationLockKey

// ClaimLockSQL is the statement a claim sends first, in the transaction of
// its lease and pick statements.
const ClaimLockSQL = claimLockSQL
