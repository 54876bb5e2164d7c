// Package projection writes absolute state from the outbox into Redis read
// models through an idempotent, order-insensitive version gate.
//
// The full reference is being written; see Keyspace, Gate and
// RedisProjector.
package projection
