// Package outbox is a transactional outbox for PostgreSQL: messages appended
// in the caller's transaction, delivered at least once by leased relays.
package outbox
