package deps

import (
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

func TestMissing(t *testing.T) {
	t.Parallel()
	var client *redis.Client
	var universal redis.UniversalClient = client
	var fn func()
	var ch chan int
	var m map[string]int
	var s []int
	for name, v := range map[string]any{"Nil": nil, "NilPointer": client, "TypedNilInInterface": universal, "NilFunc": fn, "NilChan": ch} {
		require.True(t, Missing(v), name)
	}
	for name, v := range map[string]any{"NilMap": m, "NilSlice": s} {
		require.False(t, Missing(v), "%s reads as empty", name)
	}
	live := redis.NewClient(&redis.Options{})
	t.Cleanup(func() { _ = live.Close() })
	for name, v := range map[string]any{"Client": live, "Func": func() {}, "Chan": make(chan int), "EmptyMap": map[string]int{}, "Zero": 0, "Struct": struct{}{}} {
		require.False(t, Missing(v), name)
	}
}
