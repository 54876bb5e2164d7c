package main

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
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
	// The rank lookup that the submit triggers waits for the projection
	// (read-your-writes). With the default 250 ms a loaded machine may not
	// project in time, and the page then rightly says to retry, which the
	// test does not do: the lookup gets long enough, within its poll below.
	tb := setup(t, func(c *leaderboard.Config) { c.ReadYourWritesTimeout = 5 * time.Second })
	browser, base, fail := openPage(t, tb, ServiceConfig{ReconcileEvery: time.Second, ReconcileSample: 50})

	// Someone is already ahead, so the new score ranks second.
	_, err := tb.board.Submit(context.Background(), leaderboard.Command{EventID: uuid.New(), UserID: "e2e-grace", Delta: 100})
	require.NoError(t, err)
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

// TestPageHidesARefusedLeaderboard: on a fail-closed board whose lag passes
// MaxLag (here a dead letter an hour old), the page's next refresh takes
// the last top 10 off the screen instead of leaving it there as if
// current, and shows it again once reads are answered.
func TestPageHidesARefusedLeaderboard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *leaderboard.Config) {
		c.ReadPolicy, c.MaxLag, c.LagProbeInterval = leaderboard.FailClosed, 5*time.Second, 100*time.Millisecond
	})
	browser, base, fail := openPage(t, tb, ServiceConfig{})
	_, err := tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "e2e-grace", Delta: 100})
	require.NoError(t, err)
	const grace = `#top tbody tr[data-user="e2e-grace"]`
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS(grace))); err != nil {
		fail("load the page", err)
	}

	_, err = tb.pg.Pool.Exec(ctx, `INSERT INTO verity_outbox_dead
		(id, event_id, stream, key, version, payload, created_at, attempts, last_error)
		VALUES (1000000, gen_random_uuid(), $1, 'e2e-ghost', 1, '', now() - interval '1 hour', 1, 'test')`, tb.board.Stream())
	require.NoError(t, err)
	if err := chromedp.Do(browser, chromedp.Poll[chromedp.Void](
		`document.querySelector("#top tbody").textContent.includes("not shown") && !document.querySelector(`+"`"+grace+"`"+`)`,
		chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("the refused read clears the table", err)
	}
	freshness, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#freshness")))
	if err != nil {
		fail("read the freshness line", err)
	}
	require.Contains(t, freshness, "catching up")

	_, err = tb.pg.Pool.Exec(ctx, `DELETE FROM verity_outbox_dead`)
	require.NoError(t, err)
	if err := chromedp.Do(browser, chromedp.WaitVisible(chromedp.CSS(grace))); err != nil {
		fail("the answered read shows the table again", err)
	}
}

// TestPageSaysASubmitIsNotProjectedYet: with the projection held up (the
// relays' lease table locked), a submit through the form commits and its
// read-your-writes lookup is served stale after ReadYourWritesTimeout; the
// page says the change is not projected yet and shows the score from
// before it as such, not as the result.
func TestPageSaysASubmitIsNotProjectedYet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t) // ServeStale, the default
	browser, base, fail := openPage(t, tb, ServiceConfig{})
	_, err := tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "e2e-ada", Delta: 10})
	require.NoError(t, err)
	const ada = `#top tbody tr[data-user="e2e-ada"]`
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS(ada))); err != nil {
		fail("load the page", err)
	}

	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE verity_outbox_leases IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(ctx) }) // before the service stops

	if err := chromedp.Do(browser,
		chromedp.SendKeys(chromedp.CSS("#user-id"), "e2e-ada"),
		chromedp.SetValue(chromedp.CSS("#delta"), "5"),
		chromedp.Click(chromedp.CSS("#submit")),
		chromedp.Poll[chromedp.Void](
			`document.querySelector("#rank-result").textContent.startsWith("e2e-ada: your change is not projected yet; before it: rank 1, score 10")`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("the stale lookup is labelled", err)
	}
	class, err := chromedp.Run(browser, chromedp.AttributeValue(chromedp.CSS("#rank-result"), "class"))
	if err != nil {
		fail("read the lookup's class", err)
	}
	require.Equal(t, "warn", class.Value)
	result, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#submit-result")))
	if err != nil {
		fail("read the submit result", err)
	}
	require.Contains(t, result, "e2e-ada: score 15, version 2 — applied")
}

// openPage runs a Service over tb's board, built with cfg (worker and
// scheduled reconcile included), and opens its page in headless Chromium.
// fail ends the test with the page's HTML and the browser's output.
func openPage(t *testing.T, tb *testBundle, cfg ServiceConfig) (browser context.Context, base string, fail func(step string, err error)) {
	t.Helper()
	browser, base, _, fail = openStoppablePage(t, tb, cfg)
	return browser, base, fail
}

// openStoppablePage is openPage, plus stop, which stops the service
// (listener closed) before the test ends, leaving the page open.
func openStoppablePage(t *testing.T, tb *testBundle, cfg ServiceConfig) (browser context.Context, base string, stop func(), fail func(step string, err error)) {
	t.Helper()
	chromium := chromiumPath(t)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	runCtx, stopService := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- svc.Run(runCtx, ln) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			stopService()
			require.NoError(t, <-served)
		})
	}
	t.Cleanup(stop)
	base = "http://" + ln.Addr().String()

	var browserOut lockedBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
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
	t.Cleanup(cancelAlloc)
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	t.Cleanup(cancelBrowser)

	fail = func(step string, err error) {
		t.Helper()
		html, _ := chromedp.Run(browser, chromedp.OuterHTML(chromedp.CSS("body")))
		t.Fatalf("%s: %v\npage:\n%s\nbrowser output:\n%s", step, err, html, browserOut.String())
	}
	return browser, base, stop, fail
}

// TestPageSaysTheBoardIsUnverified: with --require-verified and serve-stale, Redis
// loses the board's keys (FLUSHALL, a restart without persistence). Reads
// report the board unverified (lag -1, "unverified": true) and serve what
// Redis has: nothing. The page must not present that as an empty board
// ("no scores yet") with a calm "lag unknown", nor the lost user as a user
// who never scored.
func TestPageSaysTheBoardIsUnverified(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *leaderboard.Config) {
		c.RequireVerifiedProjection, c.ReadPolicy, c.LagProbeInterval = true, leaderboard.ServeStale, 10*time.Millisecond
	})
	_, err := tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "e2e-ada", Delta: 10})
	require.NoError(t, err)
	tb.drain(t)
	_, verified, err := tb.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)

	browser, base, fail := openPage(t, tb, ServiceConfig{}) // no scheduled reconcile
	const ada = `#top tbody tr[data-user="e2e-ada"]`
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS(ada))); err != nil {
		fail("load the page", err)
	}

	keys, err := tb.rd.Client.Keys(ctx, tb.rd.Prefix+"*").Result()
	require.NoError(t, err)
	require.NoError(t, tb.rd.Client.Del(ctx, keys...).Err()) // Redis lost the board

	// The API says so.
	time.Sleep(20 * time.Millisecond)
	res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, string(res.body), `"unverified":true`)

	if err := chromedp.Do(browser, chromedp.Poll[chromedp.Void](`!document.querySelector(`+"`"+ada+"`"+`)`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		fail("the next refresh", err)
	}
	table, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#top tbody").textContent`))
	if err != nil {
		fail("read the table", err)
	}
	freshness, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#freshness").textContent`))
	if err != nil {
		fail("read the freshness", err)
	}
	class, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#freshness").className`))
	if err != nil {
		fail("read the class", err)
	}
	t.Logf("table %q; freshness %q (class %q)", table, freshness, class)
	require.NotContains(t, table, "no scores yet", "an unverified board is not an empty one")
	require.Contains(t, freshness, "not verified", "the page must say why the lag is unknown")
	require.NotEqual(t, "muted", class, "an unverified projection is a warning, at least as much as a 5 s lag")

	// The rank lookup of the lost user.
	rank := lookUpRank(browser, fail, "e2e-ada")
	t.Logf("rank result %q", rank)
	require.Contains(t, rank, "not verified", "ada has a score in PostgreSQL: the 404's freshness says the projection is unverified")
}

// TestPageClearsTheTableWhenTheServiceIsUnreachable: the service stops answering. The page
// says "service unreachable" at the top, but must not keep the last top 10
// under a freshness line that still reads as current ("lag 2 ms").
func TestPageClearsTheTableWhenTheServiceIsUnreachable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	browser, base, stop, fail := openStoppablePage(t, tb, ServiceConfig{})
	_, err := tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "e2e-grace", Delta: 100})
	require.NoError(t, err)
	const grace = `#top tbody tr[data-user="e2e-grace"]`
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS(grace))); err != nil {
		fail("load the page", err)
	}
	stop()
	if err := chromedp.Do(browser, chromedp.Poll[chromedp.Void](
		`document.querySelector("#status").textContent.startsWith("service unreachable")`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		fail("see the service unreachable", err)
	}
	time.Sleep(1500 * time.Millisecond) // another failed refresh or two
	shown, err := chromedp.Run(browser, chromedp.Evaluate[bool](`!!document.querySelector(`+"`"+grace+"`"+`)`))
	if err != nil {
		fail("read the page", err)
	}
	freshness, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#freshness").textContent`))
	if err != nil {
		fail("read the freshness", err)
	}
	t.Logf("row shown %v; freshness %q", shown, freshness)
	require.False(t, shown && strings.HasPrefix(freshness, "freshness: source"),
		"the last answer stays on screen under its old freshness line, as if current")
}

// TestPageEscapesUserIDsAndShowsExtremeScores: a user id that is markup renders as text in
// the table, the submit answer and the rank lookup; negative and
// ±2^53 scores show exactly.
func TestPageEscapesUserIDsAndShowsExtremeScores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *leaderboard.Config) { c.MinDelta, c.MaxDelta = leaderboard.MinScore, leaderboard.MaxScore })
	browser, base, fail := openPage(t, tb, ServiceConfig{})
	const evil = `<img src=x onerror="window.pwned=1">"'&`
	res := tb.submit(t, uuid.NewString(), `{"user_id":"<img src=x onerror=\"window.pwned=1\">\"'&","delta":-7}`)
	require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
	for _, c := range []struct {
		user  string
		delta int64
	}{{"big", leaderboard.MaxScore}, {"small", leaderboard.MinScore}, {"near", leaderboard.MaxScore - 1}} {
		_, err := tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: c.user, Delta: c.delta})
		require.NoError(t, err)
	}
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS(`#top tbody tr[data-user="small"]`))); err != nil {
		fail("load the page", err)
	}
	cells, err := chromedp.Run(browser, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#top tbody tr")).map(r => r.textContent)`))
	if err != nil {
		fail("read", err)
	}
	check := func() {
		t.Helper()
		state, err := chromedp.Run(browser, chromedp.Evaluate[string](`(window.pwned ? "pwned" : "clean") + " imgs " + document.querySelectorAll("img").length`))
		if err != nil {
			fail("read", err)
		}
		require.Equal(t, "clean imgs 0", state)
	}
	check()
	t.Logf("rows %q", cells)
	require.Equal(t, []string{"1big9007199254740992", "2near9007199254740991", "3" + evil + "-7", "4small-9007199254740992"}, cells)

	// Through the form and the rank lookup too.
	if err := chromedp.Do(browser,
		chromedp.SendKeys(chromedp.CSS("#user-id"), evil),
		chromedp.SetValue(chromedp.CSS("#delta"), "-3"),
		chromedp.Click(chromedp.CSS("#submit")),
		chromedp.Poll[chromedp.Void](`document.querySelector("#rank-result").textContent.includes("score -10")`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("submit", err)
	}
	check()
}

// TestPageRankNotFoundSaysHowFresh: a user's first score is committed but
// not projected (the relays' lease table locked). Looking the user up, the
// 404 carries the answer's freshness (a lag), for "the score may exist but
// not be projected yet" (README); the page must not drop it and state
// flatly that the user has no score.
func TestPageRankNotFoundSaysHowFresh(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	browser, base, fail := openPage(t, tb, ServiceConfig{})
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#top tbody tr"))); err != nil {
		fail("load the page", err)
	}
	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE verity_outbox_leases IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(ctx) })
	_, err = tb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "e2e-new", Delta: 10})
	require.NoError(t, err)
	time.Sleep(300 * time.Millisecond)
	res := tb.do(t, http.MethodGet, "/users/e2e-new/rank", nil, "")
	require.Equal(t, http.StatusNotFound, res.status)
	t.Logf("API: %s", res.body)

	rank := lookUpRank(browser, fail, "e2e-new")
	t.Logf("page: %q", rank)
	require.Regexp(t, `lag \d`, rank, "the page must say how fresh the 'no score' answer is")
}

// lookUpRank looks user up with the page's rank form and returns the
// result line once it names the user.
func lookUpRank(browser context.Context, fail func(string, error), user string) string {
	if err := chromedp.Do(browser,
		chromedp.SendKeys(chromedp.CSS("#rank-user"), user),
		chromedp.Click(chromedp.CSS("#rank-lookup")),
		chromedp.Poll[chromedp.Void](`document.querySelector("#rank-result").textContent.startsWith(`+strconv.Quote(user+": ")+`)`,
			chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		fail("rank lookup", err)
	}
	rank, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#rank-result").textContent`))
	if err != nil {
		fail("read the rank result", err)
	}
	return rank
}

// TestPageDoubleClickSubmitsOnce: a double-click on Submit while the
// first request is still in flight (the score table locked) must not send a
// second command under a second Idempotency-Key.
func TestPageDoubleClickSubmitsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	browser, base, fail := openPage(t, tb, ServiceConfig{})
	if err := chromedp.Do(browser, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#top tbody tr"))); err != nil {
		fail("load the page", err)
	}
	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE score_events IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	released := false
	t.Cleanup(func() {
		if !released {
			_ = lock.Rollback(ctx)
		}
	})
	if err := chromedp.Do(browser,
		chromedp.SendKeys(chromedp.CSS("#user-id"), "e2e-ada"),
		chromedp.SetValue(chromedp.CSS("#delta"), "10"),
		chromedp.Click(chromedp.CSS("#submit")), // a double-click: two clicks
		chromedp.Click(chromedp.CSS("#submit")),
	); err != nil {
		fail("double-click submit", err)
	}
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, lock.Rollback(ctx))
	released = true
	if err := chromedp.Do(browser, chromedp.Poll[chromedp.Void](
		`document.querySelector("#submit-result").textContent.includes("applied")`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		fail("submit answer", err)
	}
	time.Sleep(300 * time.Millisecond)
	events, _ := tb.counts(t)
	result, _ := chromedp.Run(browser, chromedp.Evaluate[string](`document.querySelector("#submit-result").textContent`))
	t.Logf("events %d; submit result %q", events, result)
	require.Equal(t, 1, events, "one double-click, one score event")
}
