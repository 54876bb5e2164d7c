package main

import (
	"context"
	"net/http"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/reconcile"
)

// TestLibraryMetrics checks that the library's own instruments reach
// /metrics through the service's MeterProvider.
func TestLibraryMetrics(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	key := uuid.NewString()
	require.Equal(t, http.StatusCreated, tb.submit(t, key, `{"user_id":"ada","delta":5}`).status)
	require.Equal(t, http.StatusOK, tb.submit(t, key, `{"user_id":"ada","delta":5}`).status)
	tb.drain(t)
	require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/leaderboard?limit=10", nil, "").status)
	_, err := tb.svc.reconciler.Run(context.Background(), reconcile.RunOptions{})
	require.NoError(t, err)

	text := string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
	for _, want := range []string{
		`(?m)^verity_leaderboard_submits_total\{[^}]*verity_leaderboard_outcome="applied"[^}]*\} 1$`,
		`(?m)^verity_leaderboard_submits_total\{[^}]*verity_leaderboard_outcome="duplicate"[^}]*\} 1$`,
		`(?m)^verity_outbox_claimed_total\{[^}]*\} 1$`,
		`(?m)^verity_outbox_acked_total\{[^}]*\} 1$`,
		`(?m)^verity_projection_writes_total\{[^}]*verity_projection_outcome="applied"[^}]*\} 1$`,
		`(?m)^verity_projection_lag_seconds_count\{[^}]*verity_projection_name="` + testBoard + `"[^}]*\} 1$`,
		`(?m)^verity_reconcile_runs_total\{[^}]*verity_reconcile_mode="full"[^}]*\} 1$`,
		`(?m)^verity_reconcile_rows_total\{[^}]*verity_reconcile_class="current"[^}]*\} 1$`,
		`(?m)^verity_leaderboard_reads_total\{[^}]*verity_leaderboard_source="redis"[^}]*\} [1-9]\d*$`,
	} {
		require.Regexp(t, want, text)
	}
}
