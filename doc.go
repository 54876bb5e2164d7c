// Package verity keeps Redis read models honest, with PostgreSQL as the
// source of truth.
//
// Redis makes reads cheap: a sorted set answers "top 10" without asking the
// database to aggregate, a cached row answers without a query. The hard part
// is keeping that copy trustworthy when a commit, a Redis write, a worker or
// the network fails — and caches that quietly lie (a leaderboard showing a
// score the database never had, a price that reverted for 58 minutes) are
// worse than slow ones. verity is a set of small packages that implement one
// contract for keeping such projections correct.
//
// # The consistency contract
//
//   - PostgreSQL is the source of truth. Redis is a projection: it may lag,
//     it is never the authority. Anything that moves money (payouts,
//     rewards) reads PostgreSQL.
//   - Every command carries a stable event id. The state change and an
//     outbox row commit in one transaction. The same id again has no second
//     effect; the same id with a different payload is a typed conflict.
//   - The outbox carries ABSOLUTE state plus a version that increases with
//     every change of an entity — never a delta. Delivery can therefore be
//     at-least-once: an atomic Lua version gate in Redis applies a version
//     only if it is newer than the one it holds, so a duplicate or a late,
//     older delivery changes nothing.
//   - Idempotency is not repair. Redis loses keys, gets hand-edited, or
//     receives a buggy write; a reconciler compares every projected entity
//     with the source, classifies it (current, missing, stale, ahead,
//     corrupt, orphan), repairs what is safe to repair and reports the rest.
//   - Read-through caches close the stale-set race with versioned keys whose
//     version never goes backwards, even when Redis forgets it.
//   - Readers can see how fresh a projection is, fall back to PostgreSQL, or
//     fail closed.
//
// # Packages
//
//   - outbox: schema, transactional writer, command idempotency and a leased
//     relay that hands batches of records to a handler.
//   - projection: the Projector interface and a batched, Redis Cluster safe
//     Lua version gate that projects records into sorted sets, hashes or
//     documents.
//   - reconcile: classify and repair drift between PostgreSQL and a
//     projection; sampled checks; a full rebuild with an atomic switch.
//   - versioncache: a read-through cache that closes the stale-set race in
//     one Redis round trip.
//   - leaderboard: all of the above wired into a leaderboard you could ship.
//
// Data flows one way: outbox → projection → reconcile → leaderboard;
// versioncache stands alone. No lower package imports a higher one.
//
// # Bad input and contexts
//
// Bad input (a config field, a command, a key, an option) gets a typed
// error, naming the field where there is one, and writes nothing. A nil
// context.Context is not input but a programming error, as the context
// package says ("do not pass a nil Context"): it is not checked, and a
// method given one may panic, as pgx, go-redis and database/sql do. Pass
// context.Background() when there is no other.
package verity
