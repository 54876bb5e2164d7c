package main

import (
	"bytes"
	"context"
	"net"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// chromiumPath finds Debian's chromium (or another Chrome build on PATH).
// Without one the test is skipped, or fails under
// VERITY_TEST_REQUIRE_SERVICES=1 (CI installs chromium in .ci/run).
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	testenv.Unavailable(t, "no chromium on PATH (apt-get install chromium)")
	return ""
}

// lockedBuffer collects the browser's output for failure messages.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestPageEndToEnd drives the live page in headless Chromium against the
// running service (HTTP, worker, scheduled reconcile): a user submits a
// score through the form and sees it appear in the top 10 with its rank,
// the freshness line and a read-your-writes rank lookup; sending the same
// command again is reported as a duplicate and changes nothing.
func TestPageEndToEnd(t *testing.T) {
	t.Parallel()
	chromium := chromiumPath(t)
	// The rank lookup that the submit triggers waits for the projection
	// (read-your-writes). With the default 250 ms a loaded machine may not
	// project in time, and the page then rightly says to retry, which the
	// test does not do: the lookup gets long enough, within its poll below.
	tb := setup(t, func(c *leaderboard.Config) { c.ReadYourWritesTimeout = 5 * time.Second })
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ReconcileEvery: time.Second, ReconcileSample: 50})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	runCtx, stopService := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- svc.Run(runCtx, ln) }()
	t.Cleanup(func() {
		stopService()
		require.NoError(t, <-served)
	})
	base := "http://" + ln.Addr().String()

	// Someone is already ahead, so the new score ranks second.
	_, err = tb.board.Submit(context.Background(), leaderboard.Command{EventID: uuid.New(), UserID: "e2e-grace", Delta: 100})
	require.NoError(t, err)

	var browserOut lockedBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox, // we run as root
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1100, 800),
		chromedp.CombinedOutput(&browserOut),
	)
	defer cancelAlloc()
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	defer cancelBrowser()

	fail := func(step string, err error) {
		t.Helper()
		html, _ := chromedp.Run(browser, chromedp.OuterHTML(chromedp.CSS("body")))
		t.Fatalf("%s: %v\npage:\n%s\nbrowser output:\n%s", step, err, html, browserOut.String())
	}
	const row = `#top tbody tr[data-user="e2e-ada"]`

	// The page loads and its refresh shows the existing leader.
	if err := chromedp.Do(browser,
		chromedp.Navigate(base+"/"),
		chromedp.WaitVisible(chromedp.CSS(`#top tbody tr[data-user="e2e-grace"]`)),
	); err != nil {
		fail("load the page", err)
	}

	// Submit through the form, as a person would.
	if err := chromedp.Do(browser,
		chromedp.SendKeys(chromedp.CSS("#user-id"), "e2e-ada"),
		chromedp.SetValue(chromedp.CSS("#delta"), "37"),
		chromedp.Click(chromedp.CSS("#submit")),
		chromedp.WaitVisible(chromedp.CSS(row)),
	); err != nil {
		fail("submit and see the row", err)
	}
	rank, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(row+" td.rank")))
	if err != nil {
		fail("read the rank", err)
	}
	score, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(row+" td.score")))
	if err != nil {
		fail("read the score", err)
	}
	require.Equal(t, "2", rank)
	require.Equal(t, "37", score)

	freshness, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#freshness")))
	if err != nil {
		fail("read the freshness line", err)
	}
	// The lag is shown in ms, or in s from a second on (a loaded machine
	// can hold the projection back that long).
	require.Regexp(t, `^freshness: source redis · lag \S+ m?s · projected through \S`, freshness)

	// The submit answer and the read-your-writes lookup it triggers.
	if err := chromedp.Do(browser,
		chromedp.Poll[chromedp.Void](
			`document.querySelector("#rank-result").textContent.startsWith("e2e-ada: rank 2, score 37")`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("rank lookup after submit", err)
	}
	result, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#submit-result")))
	if err != nil {
		fail("read the submit result", err)
	}
	require.Contains(t, result, "e2e-ada: score 37, version 1 — applied")

	// The same command again (same Idempotency-Key): a duplicate.
	if err := chromedp.Do(browser,
		chromedp.Click(chromedp.CSS("#resend")),
		chromedp.Poll[chromedp.Void](
			`document.querySelector("#submit-result").textContent.includes("duplicate, nothing changed")`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("resend the same command", err)
	}
	events, _ := tb.counts(t)
	require.Equal(t, 2, events, "grace's and ada's events, the resend added none")

	// The last reconcile report reaches the page.
	if err := chromedp.Do(browser,
		chromedp.Poll[chromedp.Void](
			`/sample, \d+ checked/.test(document.querySelector("#reconcile").textContent)`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("see the reconcile report", err)
	}
}
