package testenv

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// DelayProxy forwards TCP connections to a server and, while a delay is
// set, holds every server-to-client chunk for that long: a slow server, a
// slow network, or a descheduled client between the server answering and
// the client reading. While frozen, a server-to-client chunk is held for
// good (until Close): its connection is half-open, as behind a NAT entry
// that died, while connections that send nothing meanwhile, and new ones,
// work again once it is thawed.
type DelayProxy struct {
	ln     net.Listener
	delay  atomic.Int64
	frozen atomic.Bool
	held   atomic.Int64 // chunks held for good while frozen
	stop   chan struct{}
	once   sync.Once
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

// StartDelayProxy listens on a free port of 127.0.0.1 and forwards to
// target (host:port); it stops at cleanup.
func StartDelayProxy(t testing.TB, target string) *DelayProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	p := &DelayProxy{ln: ln, stop: make(chan struct{})}
	p.wg.Add(1)
	go p.accept(target)
	t.Cleanup(func() {
		p.Close()
		p.wg.Wait()
	})
	return p
}

// RedisBehindDelayProxy returns a client with the options of client (a
// *redis.Client) whose connections go through a new DelayProxy in front
// of its server, the options edited by edit when it is not nil. The client
// is closed at cleanup, before the proxy.
func RedisBehindDelayProxy(t testing.TB, client redis.UniversalClient, edit func(*redis.Options)) (*redis.Client, *DelayProxy) {
	t.Helper()
	plain, ok := client.(*redis.Client)
	if !ok {
		t.Fatalf("testenv: RedisBehindDelayProxy needs a *redis.Client, not %T", client)
	}
	opts := *plain.Options()
	proxy := StartDelayProxy(t, opts.Addr)
	opts.Addr = proxy.Addr()
	if edit != nil {
		edit(&opts)
	}
	behind := redis.NewClient(&opts)
	t.Cleanup(func() { _ = behind.Close() })
	return behind, proxy
}

// Addr is the proxy's host:port.
func (p *DelayProxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's port.
func (p *DelayProxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// SetDelay holds each server-to-client chunk for d from now on; 0 passes
// them on at once.
func (p *DelayProxy) SetDelay(d time.Duration) { p.delay.Store(int64(d)) }

// Freeze holds every server-to-client chunk from now on for good; Thaw
// ends that for chunks read after it.
func (p *DelayProxy) Freeze() { p.frozen.Store(true) }

// Thaw passes server-to-client chunks on again (those held stay held).
func (p *DelayProxy) Thaw() { p.frozen.Store(false) }

// Held is how many chunks were held for good while frozen.
func (p *DelayProxy) Held() int64 { return p.held.Load() }

// Close ends every connection, the held ones included, and stops
// accepting. A test whose pool holds a frozen connection calls it before
// the pool's Close, which would wait for that connection.
func (p *DelayProxy) Close() {
	p.once.Do(func() {
		close(p.stop)
		_ = p.ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
	})
}

func (p *DelayProxy) accept(target string) {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); _, _ = io.Copy(s, c); _ = s.Close() }()
		go p.answer(c, s)
	}
}

// answer copies the server's answers to the client, delayed or held.
func (p *DelayProxy) answer(c, s net.Conn) {
	defer p.wg.Done()
	defer c.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			if p.frozen.Load() {
				p.held.Add(1)
				<-p.stop
				return
			}
			if d := time.Duration(p.delay.Load()); d > 0 {
				time.Sleep(d)
			}
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
