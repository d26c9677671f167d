# Redis for docker-compose.yml on a machine without an image registry: Debian's redis-server on
# the local base image (deploy/compose/base.sh). Where a registry is reached, compose uses the
# public redis:7-alpine instead; this image behaves like it for the compose file's command:
# the data directory /data (a volume), run as the redis user, `redis-cli` for the healthcheck.
ARG BASE=mcpb-base:bookworm
FROM ${BASE}
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
