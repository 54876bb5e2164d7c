package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestVerifyFailedPassNamesNoFalseCause: a reconcile --verify whose
// pass failed (here: Redis cannot be reached; Ctrl-C does the same) exits 1,
// and its report must not claim that the pass "left findings unrepaired, or
// Redis lost the board's keys during it": it found no findings at all, and
// nothing was lost. The report printed first is documented to say what
// stood in the way of verifying.
func TestVerifyFailedPassNamesNoFalseCause(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.seed(t, map[string]int{"ada": 30, "bob": 20})
	args := append(append([]string{"reconcile", "--verify"}, tb.opsFlags()...), "--redis-url=redis://127.0.0.1:1")
	code, stdout, stderr := runCommand(t, args...)
	require.Equal(t, exitError, code, "stdout: %s\nstderr: %s", stdout, stderr)
	require.Contains(t, stdout, "drift 0", "the pass found nothing to repair")
	require.NotContains(t, stdout, "left findings unrepaired", "a false cause: the pass failed, it left no finding")
	require.Contains(t, stdout, "NOT verified: the pass failed")
}

// TestReconcileFailedPassSaysSo: a plain reconcile whose pass failed
// (Redis cannot be reached) exits 1, and its report on stdout, whose
// "drift 0" would otherwise read as a clean board, says the pass did not
// finish.
func TestReconcileFailedPassSaysSo(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.seed(t, map[string]int{"ada": 30, "bob": 20})
	for _, extra := range [][]string{nil, {"--sample=1"}, {"--dry-run"}} {
		args := append(append(append([]string{"reconcile"}, extra...), tb.opsFlags()...), "--redis-url=redis://127.0.0.1:1")
		code, stdout, stderr := runCommand(t, args...)
		require.Equal(t, exitError, code, "%v: stdout: %s\nstderr: %s", extra, stdout, stderr)
		require.Contains(t, stdout, "drift 0", extra)
		require.Contains(t, stdout, "FAILED: the pass did not finish", extra)
	}
	// A pass that finished says no such thing.
	code, stdout, stderr := runCommand(t, append([]string{"reconcile"}, tb.opsFlags()...)...)
	require.Equal(t, exitOK, code, "stdout: %s\nstderr: %s", stdout, stderr)
	require.NotContains(t, stdout, "FAILED")
}
