package main

// The run's SQL. %[1]s is the sanitized name of the run's own table.
const (
	// row_version is bumped by the database on every write, so "older" is
	// decided by PostgreSQL's commit order, not by a price value that
	// concurrent writers do not order.
	sqlCreate = `CREATE TABLE %[1]s (
	"id"          BIGINT PRIMARY KEY,
	"price_cents" BIGINT NOT NULL,
	"row_version" BIGINT NOT NULL DEFAULT 1
)`
	sqlDrop   = `DROP TABLE IF EXISTS %[1]s`
	sqlInsert = `INSERT INTO %[1]s ("id", "price_cents") VALUES ($1, $2) RETURNING "row_version"`
	sqlSelect = `SELECT "id", "price_cents", "row_version" FROM %[1]s WHERE "id" = $1`
	sqlUpdate = `UPDATE %[1]s SET "price_cents" = $2, "row_version" = "row_version" + 1
WHERE "id" = $1 RETURNING "row_version"`
)
