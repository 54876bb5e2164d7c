package services

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestResolveInterruptedSaysSo: Ctrl-C or SIGTERM while Resolve is
// starting a private server (every example resolves its servers this way)
// must end it with the interruption, not with "no server available ...
// docker daemon not answering", which sends the user looking for a missing
// server.
func TestResolveInterruptedSaysSo(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	// Long enough for initdb to be running, short of its end.
	time.AfterFunc(300*time.Millisecond, cancel)
	ep, err := Resolve(ctx, Options{
		Getenv:           func(string) string { return "" },
		LocalPostgresURL: "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=1",
		LocalRedisURL:    "redis://127.0.0.1:1/0",
	})
	if err == nil {
		ep.Close()
		t.Skip("the private server was up before the cancellation")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("an interrupted Resolve returned %v\nwant an error wrapping context.Canceled", err)
	}
	if errors.Is(err, ErrUnavailable) {
		t.Fatalf("an interrupted Resolve reports no server available: %v", err)
	}
}
