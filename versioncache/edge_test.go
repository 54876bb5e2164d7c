package versioncache

import (
	"bytes"
	"context"
	"encoding/gob"
	"encoding/json"
	"errors"
	"net"
	"os"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// gobCodec shows that the Codec is pluggable.
type gobCodec struct{}

func (gobCodec) Marshal(v any) ([]byte, error) {
	var buf bytes.Buffer
	err := gob.NewEncoder(&buf).Encode(v)
	return buf.Bytes(), err
}

func (gobCodec) Unmarshal(data []byte, v any) error {
	return gob.NewDecoder(bytes.NewReader(data)).Decode(v)
}

func TestCodec(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Pluggable", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &Config{Codec: gobCodec{}})
		want := b.truth.write("p1", 4900)
		for range 2 {
			got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, want, got)
		}
		require.EqualValues(t, 1, b.cache.Stats().Hits)
		raw, err := b.client.Get(ctx, b.cache.currentKey("p1")).Bytes()
		require.NoError(t, err)
		version, payload, err := splitVersioned(raw)
		require.NoError(t, err)
		require.Equal(t, mustVersion(t, b, "p1"), strconv.FormatInt(version, 10))
		require.True(t, bytes.HasPrefix(payload, b.cache.shape), "behind the shape tag")
		var decoded product
		require.NoError(t, gobCodec{}.Unmarshal(payload[len(b.cache.shape):], &decoded), "stored with gob, not JSON")
		require.Equal(t, want, decoded)
	})

	// Absence is cached as a tombstone value (a loader error is not
	// cached): nil for a pointer type, as the Loader documentation says.
	t.Run("NilTombstone", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		cache, err := New[*product](rd.Client, &Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		var loads atomic.Int64
		missing := func(context.Context) (*product, error) {
			loads.Add(1)
			return nil, nil // no such row
		}
		for range 2 {
			got, err := cache.Get(ctx, "gone", missing)
			require.NoError(t, err)
			require.Nil(t, got)
			got, err = cache.GetAt(ctx, "gone", 7, missing)
			require.NoError(t, err)
			require.Nil(t, got)
		}
		require.EqualValues(t, 2, loads.Load(), "the second reads are hits")
		require.EqualValues(t, 2, cache.Stats().Hits)
	})

	// A release that changes the cached type shares the Prefix with the
	// last one during its rollout: JSON would decode the other's values
	// without complaint, a field the value lacks left at its zero value.
	t.Run("AnotherShapeIsReloaded", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		type productWithCurrency struct {
			ID       string `json:"id"`
			Price    int    `json:"price"`
			Version  int64  `json:"version"`
			Currency string `json:"currency"`
		}
		next, err := New[productWithCurrency](b.client, &Config{Prefix: b.prefix})
		require.NoError(t, err)
		b.truth.write("p1", 4900)
		_, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)

		load := func(context.Context) (productWithCurrency, error) {
			return productWithCurrency{ID: "p1", Price: 4900, Version: 1, Currency: "EUR"}, nil
		}
		for range 2 {
			got, err := next.Get(ctx, "p1", load)
			require.NoError(t, err)
			require.Equal(t, "EUR", got.Currency, "never decoded from the other release's value")
		}
		require.EqualValues(t, 1, next.Stats().Loads)
		require.EqualValues(t, 1, next.Stats().DecodeErrors)
		require.EqualValues(t, 1, next.Stats().Hits, "its own value is a hit")

		// And the other way round.
		_, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.EqualValues(t, 2, b.cache.Stats().Loads)
		require.EqualValues(t, 1, b.cache.Stats().DecodeErrors)
	})

	t.Run("ShapeTag", func(t *testing.T) {
		t.Parallel()
		type node struct {
			Name string
			Next *node
		}
		type renamed struct {
			ID    string `json:"id"`
			Price int    `json:"cost"`
		}
		type original struct {
			ID    string `json:"id"`
			Price int    `json:"price"`
		}
		tag := func(c Codec, t reflect.Type) string { return string(shapeTag(c, t)) }
		p := reflect.TypeFor[product]()
		require.Equal(t, tag(JSONCodec{}, p), tag(JSONCodec{}, p))
		require.NotEqual(t, tag(JSONCodec{}, p), tag(gobCodec{}, p), "another Codec")
		require.NotEqual(t, tag(JSONCodec{}, reflect.TypeFor[original]()), tag(JSONCodec{}, reflect.TypeFor[renamed]()), "another field tag")
		require.NotEqual(t, tag(JSONCodec{}, reflect.TypeFor[[]int]()), tag(JSONCodec{}, reflect.TypeFor[[]int64]()))
		require.NotEqual(t, tag(JSONCodec{}, reflect.TypeFor[map[string]int]()), tag(JSONCodec{}, reflect.TypeFor[map[string]any]()))
		require.Len(t, tag(JSONCodec{}, reflect.TypeFor[node]()), 9, "recursive types end")
		require.NotEqual(t, tag(&JSONCodec{}, p), tag(&gobCodec{}, p), "Codecs given as pointers")

		// The same unnamed type twice, then one of them changed.
		type before struct {
			Work struct{ Street string }
			Home struct{ Street string }
		}
		type after struct {
			Work struct{ Street string }
			Home struct{ Street, Zip string }
		}
		require.NotEqual(t, tag(JSONCodec{}, reflect.TypeFor[before]()), tag(JSONCodec{}, reflect.TypeFor[after]()), "an unnamed field type changed")

		// Two releases of one type: the same name and package, one change.
		release := func(t1, t2 reflect.Type, change string) {
			require.Equal(t, typeName(t1), typeName(t2), "two releases of one type")
			require.NotEqual(t, tag(JSONCodec{}, t1), tag(JSONCodec{}, t2), change)
		}
		var row1, row2, row3, row4, row5 reflect.Type
		{
			type row struct {
				ID    string
				cents int32
			}
			row1 = reflect.TypeOf(row{cents: 1})
		}
		{
			type row struct {
				ID    string
				cents int64
			}
			row2 = reflect.TypeOf(row{cents: 1})
		}
		{
			type row struct {
				Key   string
				cents int64
			}
			row3 = reflect.TypeOf(row{cents: 1})
		}
		{
			type row struct {
				Key   string
				cents [2]int64
			}
			row4 = reflect.TypeOf(row{cents: [2]int64{1}})
		}
		{
			type row struct {
				Key   string
				cents [3]int64
			}
			row5 = reflect.TypeOf(row{cents: [3]int64{1}})
		}
		release(row1, row2, "an unexported field's type changed")
		release(row2, row3, "a field renamed, its tag and type kept")
		release(row4, row5, "an array's length changed")
		require.NotEqual(t, tag(JSONCodec{}, reflect.TypeFor[struct{ product }]()),
			tag(JSONCodec{}, reflect.TypeFor[struct{ product product }]()), "an embedded field no longer embedded")

		// A struct Codec's own fields, unexported too, are part of its shape.
		var codec1, codec2 Codec
		{
			type fieldCodec struct {
				JSONCodec
				indent bool
			}
			codec1 = fieldCodec{indent: true}
		}
		{
			type fieldCodec struct {
				JSONCodec
				indent string
			}
			codec2 = fieldCodec{indent: "\t"}
		}
		require.Equal(t, typeName(reflect.TypeOf(codec1)), typeName(reflect.TypeOf(codec2)), "two releases of one Codec")
		require.NotEqual(t, tag(codec1, p), tag(codec2, p), "a Codec's unexported field changed")
	})

	// Peek does not repair: it reports a cached value that does not decode.
	t.Run("PeekReportsUndecodable", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), "42:not json", 0).Err())
		_, version, ok, err := b.cache.Peek(ctx, "p1")
		require.False(t, ok)
		require.EqualValues(t, 42, version)
		var cerr *CodecError
		require.ErrorAs(t, err, &cerr)
		require.ErrorIs(t, err, ErrCodec)
		require.Equal(t, "p1", cerr.ID)
		require.Equal(t, "decode", cerr.Op)
		require.ErrorContains(t, err, "decode value")
		raw, err := b.client.Get(ctx, b.cache.currentKey("p1")).Result()
		require.NoError(t, err)
		require.Equal(t, "42:not json", raw, "left in place")
		require.EqualValues(t, 1, b.cache.Stats().DecodeErrors)
	})

	// A miss answers what its hits will: the value as the Codec gives it
	// back. With encoding/json's float64 an id above 2^53 in a map came back
	// from every hit rounded to one the source never held, while the miss had
	// returned it exact.
	t.Run("MissAnswersAsHitsWill", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		cache, err := New[map[string]any](rd.Client, &Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		load := func(context.Context) (map[string]any, error) {
			return map[string]any{"id": int64(1234567890123456789), "name": "tok\xff"}, nil
		}
		want := map[string]any{"id": json.Number("1234567890123456789"), "name": "tok\ufffd"}
		for i := range 2 {
			got, err := cache.Get(ctx, "row", load)
			require.NoError(t, err)
			require.Equal(t, want, got, "Get %d", i)
			got, err = cache.GetAt(ctx, "row", 7, load)
			require.NoError(t, err)
			require.Equal(t, want, got, "GetAt %d", i)
		}
		require.EqualValues(t, 2, cache.Stats().Hits)
	})

	// A value that encodes but does not decode is refused on the miss, not
	// cached to fail every later hit.
	t.Run("ValueThatDoesNotDecode", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &Config{Codec: oneWayCodec{}})
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		var cerr *CodecError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "decode", cerr.Op)
		require.Equal(t, "p1", cerr.ID)
		n, err := b.client.Exists(ctx, b.cache.currentKey("p1")).Result()
		require.NoError(t, err)
		require.Zero(t, n, "nothing cached")
	})

	t.Run("JSONTrailingData", func(t *testing.T) {
		t.Parallel()
		var v int
		require.Error(t, JSONCodec{}.Unmarshal([]byte("1 2"), &v))
		require.NoError(t, JSONCodec{}.Unmarshal([]byte(" 1\n"), &v))
		require.Equal(t, 1, v)
	})

	t.Run("UnencodableValue", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		cache, err := New[func()](rd.Client, &Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		_, err = cache.Get(ctx, "f", func(context.Context) (func(), error) { return func() {}, nil })
		var cerr *CodecError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "f", cerr.ID)
		require.ErrorIs(t, err, ErrCodec)
	})
}

// oneWayCodec encodes and never decodes.
type oneWayCodec struct{ JSONCodec }

func (oneWayCodec) Unmarshal([]byte, any) error { return errors.New("one way") }

func mustVersion(t *testing.T, b *testBundle, id string) string {
	t.Helper()
	r, err := b.cache.read(context.Background(), id, false, true)
	require.NoError(t, err)
	require.NotEmpty(t, r.version)
	return r.version
}

func TestSharedLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// The goroutine running a shared load gives up; the one that joined it
	// must not inherit the cancellation.
	t.Run("LeaderCanceled", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		want := b.truth.write("p1", 1)
		leaderCtx, cancel := context.WithCancel(ctx)
		started := make(chan struct{})
		leaderErr := make(chan error, 1)
		go func() {
			_, err := b.cache.Get(leaderCtx, "p1", func(ctx context.Context) (product, error) {
				close(started)
				<-ctx.Done()
				return product{}, ctx.Err()
			})
			leaderErr <- err
		}()
		<-started
		joined := make(chan product, 1)
		go func() {
			p, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			if err != nil {
				t.Errorf("joiner: %v", err)
			}
			joined <- p
		}()
		require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
		require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
		cancel()
		require.ErrorIs(t, <-leaderErr, context.Canceled)
		require.Equal(t, want, <-joined)
		require.EqualValues(t, 1, b.truth.loads.Load(), "only the joiner's own loader read the truth")
	})

	// The loader may report its caller's cancellation as any error: an i/o
	// timeout from a connection deadline set from ctx, an RPC's Canceled
	// status that wraps no context error. Once that caller's ctx has ended,
	// the one that joined it loads again, whatever the error.
	t.Run("LeaderCanceledWithOtherError", func(t *testing.T) {
		t.Parallel()
		leaderErrs := map[string]error{
			"Opaque":      opaqueCanceledError{},
			"NetDeadline": &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded},
		}
		for _, name := range []string{"Get", "GetAt"} {
			for errName, leaderErr := range leaderErrs {
				t.Run(name+errName, func(t *testing.T) {
					t.Parallel()
					b := setup(t, nil)
					want := b.truth.write("p1", 1)
					get := func(ctx context.Context, load Loader[product]) (product, error) {
						if name == "GetAt" {
							return b.cache.GetAt(ctx, "p1", want.Version, load)
						}
						return b.cache.Get(ctx, "p1", load)
					}
					leaderCtx, cancel := context.WithCancel(ctx)
					defer cancel()
					started := make(chan struct{})
					leaderDone := make(chan error, 1)
					go func() {
						_, err := get(leaderCtx, func(ctx context.Context) (product, error) {
							close(started)
							<-ctx.Done()
							return product{}, leaderErr
						})
						leaderDone <- err
					}()
					<-started
					joined := make(chan product, 1)
					go func() {
						p, err := get(ctx, b.truth.loader("p1"))
						if err != nil {
							t.Errorf("joiner: %v", err)
						}
						joined <- p
					}()
					require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
					require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
					cancel()
					require.ErrorIs(t, <-leaderDone, leaderErr)
					require.Equal(t, want, <-joined)
					require.EqualValues(t, 1, b.truth.loads.Load(), "the joiner ran its own loader")
					st := b.cache.Stats()
					require.EqualValues(t, 2, st.Loads, "the leader's load and the joiner's")
					require.Zero(t, st.SharedLoads, "the joined load answered nothing")
				})
			}
		}
	})

	// A joiner whose own ctx ends while it waits is answered by its ctx,
	// not by the load: a miss, not a shared load.
	t.Run("JoinerCanceled", func(t *testing.T) {
		t.Parallel()
		for _, name := range []string{"Get", "GetAt"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, nil)
				want := b.truth.write("p1", 1)
				get := func(ctx context.Context, load Loader[product]) (product, error) {
					if name == "GetAt" {
						return b.cache.GetAt(ctx, "p1", want.Version, load)
					}
					return b.cache.Get(ctx, "p1", load)
				}
				started, release := make(chan struct{}), make(chan struct{})
				leader := make(chan product, 1)
				go func() {
					p, err := get(ctx, func(ctx context.Context) (product, error) {
						close(started)
						<-release
						return b.truth.loader("p1")(ctx)
					})
					if err != nil {
						t.Errorf("leader: %v", err)
					}
					leader <- p
				}()
				<-started
				joinerCtx, cancel := context.WithCancel(ctx)
				joinerErr := make(chan error, 1)
				go func() {
					_, err := get(joinerCtx, b.truth.loader("p1"))
					joinerErr <- err
				}()
				require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
				require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
				cancel()
				require.ErrorIs(t, <-joinerErr, context.Canceled)
				close(release)
				require.Equal(t, want, <-leader)
				st := b.cache.Stats()
				require.Zero(t, st.SharedLoads, "the joiner was answered by its own ctx")
				require.EqualValues(t, 1, st.Loads)
				require.EqualValues(t, 2, st.Misses)
			})
		}
	})

	t.Run("LoaderPanics", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		require.Panics(t, func() {
			_, _ = b.cache.Get(ctx, "p1", func(context.Context) (product, error) { panic("boom") })
		})
		// The flight was released: the next Get loads normally.
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, 1, got.Price)
	})

	// The panic goes on in the caller that ran the loader; the caller
	// sharing the load gets a *LoadError, like any other failed load.
	t.Run("LoaderPanicsWhileShared", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		release := make(chan struct{})
		panicked := make(chan any, 1)
		go func() {
			defer func() { panicked <- recover() }()
			_, _ = b.cache.Get(ctx, "p1", func(context.Context) (product, error) {
				<-release
				panic("boom")
			})
		}()
		require.Eventually(t, func() bool { return b.cache.Stats().Misses == 1 }, 5*time.Second, time.Millisecond)
		joined := make(chan error, 1)
		go func() {
			_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			joined <- err
		}()
		require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
		require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
		close(release)
		require.Equal(t, "boom", <-panicked)
		err := <-joined
		require.ErrorIs(t, err, ErrLoad)
		require.ErrorContains(t, err, "panicked")
		require.Zero(t, b.truth.loads.Load(), "the joiner did not load")
	})

	// The loader's own failure (its query's context.WithTimeout, a
	// connection's i/o timeout, the database down) while every caller's ctx
	// is live: the callers sharing the load get its error, instead of each
	// running the failing load again, one after another.
	t.Run("LoaderErrorIsShared", func(t *testing.T) {
		t.Parallel()
		loadErrs := map[string]error{
			"Timeout":     context.DeadlineExceeded,
			"NetDeadline": &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded},
			"Opaque":      errors.New("database down"),
		}
		for _, name := range []string{"Get", "GetAt"} {
			for errName, loadErr := range loadErrs {
				t.Run(name+errName, func(t *testing.T) {
					t.Parallel()
					b := setup(t, nil)
					b.truth.write("p1", 1)
					get := func(load Loader[product]) error {
						var err error
						if name == "GetAt" {
							_, err = b.cache.GetAt(ctx, "p1", 1, load)
						} else {
							_, err = b.cache.Get(ctx, "p1", load)
						}
						return err
					}
					const callers = 4
					var loads atomic.Int64
					release := make(chan struct{})
					load := func(context.Context) (product, error) {
						loads.Add(1)
						<-release
						return product{}, loadErr
					}
					errs := make(chan error, callers)
					for range callers {
						go func() { errs <- get(load) }()
					}
					require.Eventually(t, func() bool { return b.cache.Stats().Misses == callers }, 5*time.Second, time.Millisecond)
					require.Eventually(t, func() bool { return b.cache.flights.joiners() == callers-1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
					close(release)
					for range callers {
						err := <-errs
						var lerr *LoadError
						require.ErrorAs(t, err, &lerr)
						require.ErrorIs(t, err, loadErr)
					}
					require.EqualValues(t, 1, loads.Load(), "the joiners loaded again")
					require.EqualValues(t, callers-1, b.cache.Stats().SharedLoads)
				})
			}
		}
	})
}

// opaqueCanceledError is a loader's report of its ctx ending that wraps no
// context error, as an RPC client's Canceled status may be.
type opaqueCanceledError struct{}

func (opaqueCanceledError) Error() string { return "rpc error: code = Canceled" }

func TestCheckMoved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A write lands while Check compares: committed, then invalidated, and
	// (Refilled) cached again by a Get, under a new version, before Check
	// looks again.
	for name, refill := range map[string]bool{"Invalidated": false, "Refilled": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.truth.write("p1", 1)
			_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)

			calls := 0
			report, err := b.cache.Check(ctx, []string{"p1"}, 1, func(ctx context.Context, id string) (product, error) {
				calls++
				if calls == 1 {
					b.truth.write(id, 2)
					if err := b.cache.Invalidate(ctx, id); err != nil {
						return product{}, err
					}
					if refill {
						if _, err := b.cache.Get(ctx, id, b.truth.loader(id)); err != nil {
							return product{}, err
						}
					}
				}
				return b.truth.read(id), nil
			})
			require.NoError(t, err)
			require.Equal(t, 1, report.Moved)
			require.Zero(t, report.Divergent)
		})
	}
}

// A process whose load failed gives its lease up at once: another process
// then loads without waiting for the lease to lapse.
func TestLeaseReleasedOnLoadError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{FillLeaseWait: 10 * time.Second})
	want := src.write("p", 1)
	_, err := caches[0].Get(ctx, "p", func(context.Context) (product, error) {
		return product{}, context.DeadlineExceeded
	})
	require.ErrorIs(t, err, ErrLoad)

	got, err := caches[1].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Zero(t, caches[1].Stats().LeaseWaits, "no lease left to wait for")
}

// A process whose loader panicked gives its lease up too (the panic goes on
// in its caller): another process then loads without waiting for the lease
// to lapse.
func TestLeaseReleasedOnLoaderPanic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{FillLeaseWait: 10 * time.Second})
	want := src.write("p", 1)
	require.PanicsWithValue(t, "boom", func() {
		_, _ = caches[0].Get(ctx, "p", func(context.Context) (product, error) { panic("boom") })
	})

	got, err := caches[1].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Zero(t, caches[1].Stats().LeaseWaits, "no lease left to wait for")
}

// TestFillOutlivesTheLoadingCaller ends the loading caller's ctx right
// after its load succeeded: the fill, which every joined caller and
// waiting process depends on (it also releases the lease), still runs, so
// the next process finds the value cached instead of waiting out the
// lease.
func TestFillOutlivesTheLoadingCaller(t *testing.T) {
	t.Parallel()
	caches, src := newProcesses(t, 2, Config{FillLeaseWait: 10 * time.Second})
	want := src.write("p", 1)
	ctx, cancel := context.WithCancel(context.Background())
	_, _ = caches[0].Get(ctx, "p", func(ctx context.Context) (product, error) {
		p, err := src.loader("p")(ctx)
		cancel() // the request ends as its load returns
		return p, err
	})

	got, err := caches[1].Get(context.Background(), "p", func(context.Context) (product, error) {
		return product{}, errors.New("loaded again: the value was not cached")
	})
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Zero(t, caches[1].Stats().LeaseWaits, "no lease left to wait for")
}

// TestGetAtFillOutlivesTheLoadingCaller is TestFillOutlivesTheLoadingCaller
// for GetAt: the loading caller gives up while a joined caller waits for
// its load. The joiner is served the value, and the fill runs on for it, so
// the next read is a hit rather than another load.
func TestGetAtFillOutlivesTheLoadingCaller(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, nil)
	want := b.truth.write("p1", 4900)

	started, release := make(chan struct{}), make(chan struct{})
	leaderCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	leaderDone := make(chan struct{})
	go func() {
		defer close(leaderDone)
		_, _ = b.cache.GetAt(leaderCtx, "p1", want.Version, func(ctx context.Context) (product, error) {
			close(started)
			<-release // a slow query that finishes although its ctx ended
			return b.truth.loader("p1")(ctx)
		})
	}()
	<-started
	joined := make(chan product, 1)
	go func() {
		p, err := b.cache.GetAt(ctx, "p1", want.Version, b.truth.loader("p1"))
		if err != nil {
			t.Errorf("joiner: %v", err)
		}
		joined <- p
	}()
	require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
	cancel() // the loading caller gives up
	close(release)
	<-leaderDone
	require.Equal(t, want, <-joined)

	got, err := b.cache.GetAt(ctx, "p1", want.Version, func(context.Context) (product, error) {
		return product{}, errors.New("loaded again: the value was not cached")
	})
	require.NoError(t, err)
	require.Equal(t, want, got)
	st := b.cache.Stats()
	require.EqualValues(t, 1, st.Fills)
	require.Zero(t, st.RedisErrors)
}

// TestPlainJSON: values that cannot hold an interface skip JSONCodec's
// Decoder (json.Unmarshal decodes them the same); the rest keep it, for
// json.Number.
func TestPlainJSON(t *testing.T) {
	t.Parallel()
	type tree struct{ Kids []*tree }
	for _, tc := range []struct {
		name  string
		typ   reflect.Type
		codec Codec
		plain bool
	}{
		{"Struct", reflect.TypeFor[product](), JSONCodec{}, true},
		{"Ints", reflect.TypeFor[map[string][]int](), JSONCodec{}, true},
		{"Any", reflect.TypeFor[any](), JSONCodec{}, false},
		{"MapOfAny", reflect.TypeFor[map[string]any](), JSONCodec{}, false},
		{"NestedAny", reflect.TypeFor[struct{ P *struct{ V [2][]any } }](), JSONCodec{}, false},
		{"Recursive", reflect.TypeFor[tree](), JSONCodec{}, false},
		{"OtherCodec", reflect.TypeFor[product](), gobCodec{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.plain, plainJSON(tc.codec, tc.typ))
		})
	}
}

// TestHitFoundByTheMissScript has another process fill the value between
// a Get's GET, which misses, and its miss script, which then finds the
// value: the call is a hit (one read, served from Redis, no load), as
// Stats documents, not a call counted as neither hit nor miss.
func TestHitFoundByTheMissScript(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	peer := setupWith(t, rd.Client, rd.Prefix, nil)
	want := peer.truth.write("p1", 4900)

	opt, err := redis.ParseURL(rd.URL)
	require.NoError(t, err)
	client := redis.NewClient(opt)
	t.Cleanup(func() { _ = client.Close() })
	b := setupWith(t, client, rd.Prefix, nil)
	client.AddHook(afterFirstGet{once: new(sync.Once), fill: func() {
		_, err := peer.cache.Get(ctx, "p1", peer.truth.loader("p1"))
		require.NoError(t, err)
	}})

	require.Equal(t, want, b.hit(t, "p1"))
	require.EqualValues(t, 1, peer.truth.loads.Load(), "the peer filled after the GET")
	st := b.cache.Stats()
	require.EqualValues(t, 1, st.Hits)
	require.Zero(t, st.Misses)
	require.Zero(t, st.Loads)
}

// afterFirstGet calls fill once, after the first GET its client sends has
// been answered.
type afterFirstGet struct {
	testenv.PassThroughHook
	fill func()
	once *sync.Once
}

func (h afterFirstGet) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cmd.Name() == "get" {
			h.once.Do(h.fill)
		}
		return err
	}
}
