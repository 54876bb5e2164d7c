package outbox

import "time"

// Backoff exposes the retry delay computation to the external tests.
func (r *Relay) Backoff(attempts int) time.Duration { return r.backoff(attempts) }

// ClaimSQL exposes the claim statement so a test can inspect its plan.
func (r *Relay) ClaimSQL() string { return r.claimSQL }
