package testenv

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
)

// LogSink collects a logger's lines, as JSON, from any goroutine, for tests
// that check what a package logs. Its zero value is ready to use.
type LogSink struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (s *LogSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

// Logger returns a logger writing every level into s.
func (s *LogSink) Logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(s, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// Lines returns the lines logged so far, decoded: those whose message is
// msg, or all of them when msg is "".
func (s *LogSink) Lines(t testing.TB, msg string) []map[string]any {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for line := range bytes.Lines(s.buf.Bytes()) {
		var m map[string]any
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("testenv: a log line is not JSON: %v: %q", err, line)
		}
		if msg == "" || m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}
