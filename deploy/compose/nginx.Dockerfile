# nginx for docker-compose.yml on a machine without an image registry: Debian's nginx on the
# local base image (deploy/compose/base.sh). Where a registry is reached, compose uses the public
# nginx:1.27-alpine instead; like it, this runs `nginx -g 'daemon off;'` with its logs on the
# container's stdout and stderr, and takes its configuration at /etc/nginx/nginx.conf.
ARG BASE=mcpb-base:bookworm
FROM ${BASE}
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update -qq \
    && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light \
         || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx; } \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /etc/nginx/sites-enabled/* \
    && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 8080
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
