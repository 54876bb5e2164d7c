package services

import (
	"context"
	"fmt"
	"time"

	"github.com/ory/dockertest/v3"
	"github.com/ory/dockertest/v3/docker"
)

// dockerWait bounds how long a container may take to answer.
const dockerWait = 60 * time.Second

// startContainer runs image:tag through dockertest when a Docker daemon
// answers, waits for ping to succeed on the mapped port and returns the URL.
func startContainer(ctx context.Context, repo, tag string, env []string, port string,
	url func(hostPort string) string, ping func(context.Context, string) error,
) (string, func(), error) {
	pool, err := dockertest.NewPool("")
	if err != nil {
		return "", nil, err
	}
	if err := pool.Client.Ping(); err != nil {
		return "", nil, fmt.Errorf("docker daemon not answering: %w", err)
	}
	res, err := pool.RunWithOptions(&dockertest.RunOptions{Repository: repo, Tag: tag, Env: env},
		func(hc *docker.HostConfig) {
			hc.AutoRemove = true
			hc.RestartPolicy = docker.RestartPolicy{Name: "no"}
		})
	if err != nil {
		return "", nil, err
	}
	// A safety net: the container removes itself even if Close is never called.
	_ = res.Expire(uint(time.Hour / time.Second))
	u := url(res.GetHostPort(port))
	pool.MaxWait = dockerWait
	if err := pool.Retry(func() error { return ping(ctx, u) }); err != nil {
		_ = pool.Purge(res)
		return "", nil, err
	}
	return u, func() { _ = pool.Purge(res) }, nil
}

func startDockerPostgres(ctx context.Context, _ string) (string, func(), error) {
	return startContainer(ctx, "postgres", "15", []string{"POSTGRES_HOST_AUTH_METHOD=trust"}, "5432/tcp",
		func(hp string) string { return "postgres://postgres@" + hp + "/postgres?sslmode=disable" }, pingPostgres)
}

func startDockerRedis(ctx context.Context, _ string) (string, func(), error) {
	return startContainer(ctx, "redis", "7.0", nil, "6379/tcp",
		func(hp string) string { return "redis://" + hp + "/0" }, pingRedis)
}
