package main

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of the CPU times in /proc (USER_HZ), 100 per
// second on every Linux architecture Go supports.
const clockTick = 10 * time.Millisecond

// hostCPU is what /proc says about this host's CPU time so far: that of
// every process named postgres, and the host's busy and total time. ok is
// false where it cannot be read (not Linux), and when PostgreSQL is not on
// this host: the harness then cannot tell its share.
type hostCPU struct {
	postgres, busy, total time.Duration
	ok                    bool
}

// add returns h plus sign times o (sign 1 or -1); not ok unless both are.
func (h hostCPU) add(o hostCPU, sign time.Duration) hostCPU {
	if !h.ok || !o.ok {
		return hostCPU{}
	}
	return hostCPU{postgres: h.postgres + sign*o.postgres, busy: h.busy + sign*o.busy, total: h.total + sign*o.total, ok: true}
}

// busyPercent is the share of the CPU time h spans that the CPUs were
// busy, when h tells.
func (h hostCPU) busyPercent() (float64, bool) {
	if !h.ok || h.total <= 0 {
		return 0, false
	}
	return 100 * float64(h.busy) / float64(h.total), true
}

// readHostCPU reads hostCPU if pgHost (the pool's host) is this host.
// Every process named postgres counts, another cluster's too if one runs
// here: a diagnostic for the log, not a figure.
func readHostCPU(pgHost string) hostCPU {
	if !onThisHost(pgHost) {
		return hostCPU{}
	}
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return hostCPU{}
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	h, ok := parseCPULine(line)
	if !ok {
		return hostCPU{}
	}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	found := false
	for _, dir := range dirs {
		b, err := os.ReadFile(dir + "/stat")
		if err != nil {
			continue // the process ended
		}
		if ticks, ok := postgresTicks(string(b)); ok {
			h.postgres += time.Duration(ticks) * clockTick
			found = true
		}
	}
	h.ok = found
	return h
}

// parseCPULine reads the busy and total time from /proc/stat's first line,
// "cpu  user nice system idle iowait irq softirq steal guest guest_nice".
// The kernel already counts guest time in user and guest_nice in nice, so
// the fields after steal are left out rather than counted twice.
func parseCPULine(line string) (hostCPU, bool) {
	fields := strings.Fields(line)
	if len(fields) < 6 || fields[0] != "cpu" {
		return hostCPU{}, false
	}
	var h hostCPU
	for i, f := range fields[1:min(len(fields), 9)] {
		ticks, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return hostCPU{}, false
		}
		h.total += time.Duration(ticks) * clockTick
		if i != 3 && i != 4 { // neither idle nor waiting for I/O
			h.busy += time.Duration(ticks) * clockTick
		}
	}
	return h, true
}

// postgresTicks reads a /proc/<pid>/stat line, "pid (comm) state ppid ...",
// and returns the CPU ticks of a process named postgres: its own (utime,
// stime) and those of its children that have exited and been waited for
// (cutime, cstime). The postmaster's children are the backends, so a
// backend that exits within a measured window still counts: its time moves
// to the postmaster's cutime and cstime.
func postgresTicks(stat string) (int64, bool) {
	open, closing := strings.IndexByte(stat, '('), strings.LastIndexByte(stat, ')')
	if open < 0 || closing < open || stat[open+1:closing] != "postgres" {
		return 0, false
	}
	// After the comm, fields 14 to 17 of the line are at 11 to 14.
	rest := strings.Fields(stat[closing+1:])
	if len(rest) < 15 {
		return 0, false
	}
	var sum int64
	for _, f := range rest[11:15] {
		ticks, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return 0, false
		}
		sum += ticks
	}
	return sum, true
}

// onThisHost reports whether host, a pgconn host, is this machine: a
// loopback address, localhost, or a Unix socket directory.
func onThisHost(host string) bool {
	if strings.HasPrefix(host, "/") || host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
