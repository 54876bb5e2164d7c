package leaderboard

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// delayProxy forwards TCP to target and, while delay is set, holds every
// server-to-client chunk for that long: a slow network, or a descheduled
// client, between the server answering a query and the client reading it.
// While frozen is set, a server-to-client chunk is held for good (until the
// test's cleanup): its connection is half-open, as behind a NAT entry that
// died, while connections that send nothing meanwhile, and new ones, work
// again once it is cleared.
type delayProxy struct {
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

func startDelayProxy(t *testing.T, target string) *delayProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &delayProxy{ln: ln, stop: make(chan struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(s, c); s.Close() }()
			go func() {
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
			}()
		}
	}()
	t.Cleanup(func() {
		p.close()
		p.wg.Wait()
	})
	return p
}

// close ends every connection, the held ones included, and stops
// accepting. A test whose pool holds a frozen connection calls it before
// the pool's Close, which would wait for that connection.
func (p *delayProxy) close() {
	p.once.Do(func() {
		close(p.stop)
		p.ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
	})
}
