package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/leaderboard"
)

// TestPageFilesUnderPolicy: the page's script and style are files of this
// service, served with their own types, so that the Content-Security-Policy
// can forbid inline script (the page itself is checked in a browser by the
// end-to-end tests, which run under that policy).
func TestPageFilesUnderPolicy(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	page := tb.do(t, http.MethodGet, "/", nil, "")
	require.Equal(t, http.StatusOK, page.status)
	require.Contains(t, string(page.body), `<script src="/app.js" defer></script>`)
	require.NotContains(t, string(page.body), "<script>", "no inline script: the policy would block it")
	require.NotContains(t, string(page.body), "<style>", "no inline style: the policy would block it")

	policy := page.header.Get("Content-Security-Policy")
	require.Contains(t, policy, "script-src 'self'")
	require.Contains(t, policy, "frame-ancestors 'none'")
	require.NotContains(t, policy, "unsafe-inline")

	for path, contentType := range map[string]string{"/app.js": "text/javascript", "/app.css": "text/css"} {
		res := tb.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusOK, res.status, path)
		require.Contains(t, res.header.Get("Content-Type"), contentType, path)
		require.NotEmpty(t, res.body, path)
		require.Equal(t, policy, res.header.Get("Content-Security-Policy"), path)
	}
	require.Contains(t, string(tb.do(t, http.MethodGet, "/app.js", nil, "").body), "function lookupRank")
}

// TestAllowedHosts: a service that allows only the loopback names answers
// 421 to a request naming another host (a page on that host's site that
// DNS rebinding pointed at 127.0.0.1), which reaches no route: a submit so
// sent writes nothing.
func TestAllowedHosts(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{AllowedHosts: loopbackHosts})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Close()) })
	srv := newServer(t, svc)

	send := func(t *testing.T, host, method, path, body string) (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), method, srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Host = host
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", uuid.NewString())
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}

	t.Run("OtherHostRefused", func(t *testing.T) {
		for _, host := range []string{"evil.example", "evil.example:8080", "127.0.0.2:8080", "localhost.evil.example", "[::2]:8080", "127.0.0.1.nip.example"} {
			status, body := send(t, host, http.MethodPost, "/scores", `{"user_id":"rebound","delta":5}`)
			require.Equal(t, http.StatusMisdirectedRequest, status, "Host %q: %s", host, body)
			require.Contains(t, body, "--allowed-hosts", "Host %q: the answer says how to allow it", host)
			status, _ = send(t, host, http.MethodGet, "/", "")
			require.Equal(t, http.StatusMisdirectedRequest, status, "Host %q", host)
		}
		var n int
		require.NoError(t, tb.pg.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM "`+tb.pg.Schema+`"."user_scores" WHERE "user_id" = 'rebound'`).Scan(&n))
		require.Zero(t, n, "a refused submit wrote nothing")
	})

	t.Run("LoopbackNamesServed", func(t *testing.T) {
		for _, host := range []string{"localhost:8080", "LocalHost", "127.0.0.1:8080", "127.0.0.1", "[::1]:8080", "::1"} {
			status, body := send(t, host, http.MethodPost, "/scores", `{"user_id":"local","delta":1}`)
			require.Equal(t, http.StatusCreated, status, "Host %q: %s", host, body)
		}
	})
}

// TestHostAllowList: --allowed-hosts, and its default from --addr.
func TestHostAllowList(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		addr, flag string
		want       []string
		wantErr    string
	}{
		{addr: "127.0.0.1:8080", want: loopbackHosts},
		{addr: "[::1]:0", want: loopbackHosts},
		{addr: "localhost:8080", want: loopbackHosts},
		{addr: "127.0.0.2:8080", want: append(slices.Clone(loopbackHosts), "127.0.0.2")},
		{addr: ":8080"},
		{addr: "0.0.0.0:8080"},
		{addr: "10.1.2.3:8080"},
		{addr: "127.0.0.1:8080", flag: "*"},
		{addr: "127.0.0.1:8080", flag: "scores.example, 10.1.2.3,::1,", want: []string{"scores.example", "10.1.2.3", "::1"}},
		{addr: ":8080", flag: "scores.example:443", wantErr: "without a port"},
		{addr: ":8080", flag: "[::1]", wantErr: "without a port or brackets"},
		{addr: ":8080", flag: "*,scores.example", wantErr: "give it alone"},
		{addr: ":8080", flag: " , ", wantErr: "no host named"},
	} {
		o := &options{addr: c.addr, allowedHosts: c.flag}
		got, err := o.hostAllowList()
		if c.wantErr != "" {
			require.ErrorContains(t, err, c.wantErr, "%+v", c)
			continue
		}
		require.NoError(t, err, "%+v", c)
		require.Equal(t, c.want, got, "%+v", c)
	}

	// A bad list is a usage error, found before anything connects.
	var stderr strings.Builder
	_, err := parseFlags("serve", []string{"--allowed-hosts", "a.example:80"}, &stderr)
	require.Error(t, err)
	require.Contains(t, stderr.String(), "--allowed-hosts")
}

// TestPageShowsTheLatestRankLookup: two rank lookups in flight (a submit's
// read-your-writes lookup and a manual one, or two manual ones) may answer
// out of order; the line shows the answer to the latest, not whichever
// came last.
func TestPageShowsTheLatestRankLookup(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, user := range []string{"slow-user", "fast-user"} {
		_, err := tb.board.Submit(context.Background(), leaderboard.Command{EventID: uuid.New(), UserID: user, Delta: 10})
		require.NoError(t, err)
	}
	tb.drain(t)
	browser, base, fail := openPage(t, tb, ServiceConfig{})

	// A proxy in front of the service holds the answer to slow-user's
	// lookup until released.
	target, err := url.Parse(base)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	release := make(chan struct{})
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/users/slow-user/rank" {
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})

	lookup := func(user string) []chromedp.Action[chromedp.Void] {
		return []chromedp.Action[chromedp.Void]{
			chromedp.SetValue(chromedp.CSS("#rank-user"), user),
			chromedp.Click(chromedp.CSS("#rank-lookup")),
		}
	}
	steps := []chromedp.Action[chromedp.Void]{
		chromedp.Navigate(front.URL + "/"),
		chromedp.WaitVisible(chromedp.CSS(`#top tbody tr[data-user="fast-user"]`)),
	}
	steps = append(steps, lookup("slow-user")...)
	steps = append(steps, lookup("fast-user")...)
	steps = append(steps, chromedp.Poll[chromedp.Void](
		`document.querySelector("#rank-result").textContent.startsWith("fast-user: rank")`,
		chromedp.WithPollingTimeout(10*time.Second)))
	if err := chromedp.Do(browser, steps...); err != nil {
		fail("look up two users", err)
	}

	// slow-user's answer arrives last; the page has read it once the
	// browser lists the response as loaded, and a moment after.
	close(release)
	if err := chromedp.Do(browser, chromedp.Poll[chromedp.Void](
		`performance.getEntriesByType("resource").some(e => e.name.endsWith("/users/slow-user/rank"))`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		fail("wait for the older answer", err)
	}
	text, err := chromedp.Run(browser, chromedp.Evaluate[string](
		`new Promise(done => setTimeout(() => done(document.querySelector("#rank-result").textContent), 300))`,
		chromedp.EvalAwaitPromise))
	if err != nil {
		fail("read the rank line", err)
	}
	require.True(t, strings.HasPrefix(text, "fast-user: rank"), "the older lookup's answer replaced the newer: %q", text)
}

// TestDefaultHostsOnAnotherLoopbackAddress: a service on a loopback
// address other than 127.0.0.1 and ::1 (--addr=127.0.0.2:PORT) answers a
// request naming its own address under the default --allowed-hosts.
func TestDefaultHostsOnAnotherLoopbackAddress(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	require.NoError(t, err)
	o := &options{addr: ln.Addr().String()}
	hosts, err := o.hostAllowList()
	require.NoError(t, err)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{AllowedHosts: hosts})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	srv := httptest.NewUnstartedServer(svc.Handler())
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	resp, err := http.Get(srv.URL + "/leaderboard")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "GET %s/leaderboard on --addr=%s (default list %v)", srv.URL, o.addr, hosts)
}

// TestOptionsStarGoesThroughHostCheck: net/http answers "OPTIONS *"
// itself, before any handler, unless told not to: with a Host naming
// another site it got 200, without the Content-Security-Policy.
func TestOptionsStarGoesThroughHostCheck(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{AllowedHosts: loopbackHosts})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx, ln) }()
	t.Cleanup(func() { cancel(); <-done; _ = svc.Close() })

	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write([]byte("OPTIONS * HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"))
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMisdirectedRequest, resp.StatusCode, "OPTIONS * with Host evil.example; headers %v", resp.Header)
	require.NotEmpty(t, resp.Header.Get("Content-Security-Policy"))
}
