package projection_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/verity-go/verity/projection"
)

// Check at startup that Redis cannot evict the gate's version keys: a
// warning, not a refusal, since a reconcile pass repairs what an eviction
// breaks; a server that refuses to say is not a finding either.
func ExampleCheckEvictionPolicy() {
	client, _, _, cleanup, err := exampleRedis()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()

	err = projection.CheckEvictionPolicy(context.Background(), client)
	switch {
	case errors.Is(err, projection.ErrEvictionPolicy):
		fmt.Println("warning:", err)
	case err != nil:
		fmt.Println("could not check the eviction policy:", err)
	default:
		fmt.Println("the version keys cannot be evicted")
	}
	// Output: the version keys cannot be evicted
}
