# mcp-broker: one image for HTTP workers (`serve`) and the stand-alone fan-out (`fanout`).
# The base is any image with Python 3.11+ and its venv module: the public python:3.11-slim by
# default; `make compose-test` builds on a local Debian bookworm made with debootstrap
# (--build-arg BASE=..., deploy/compose/base.sh), for a machine without an image registry.
ARG BASE=python:3.11-slim
FROM ${BASE}

# Each ENV on one line: tests/distributed/test_rolling_restart.py reads the image's settings from them.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
WORKDIR /app

# The dependencies, in a layer of their own: it is rebuilt only when deploy/constraints.txt (their
# exact versions) changes, not on every change to the code. A venv, so a Debian python3 (PEP 668)
# works as well as the official image's. They include the [tracing] extra's (OpenTelemetry's SDK and
# OTLP/HTTP exporter): the image traces when OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/TRACING.md).
COPY deploy/constraints.txt /opt/constraints.txt
RUN python3 -m venv /opt/venv && pip install -r /opt/constraints.txt

COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
COPY broker_client ./broker_client
# --no-deps: everything it needs is installed above; `pip check` fails the build if the
# constraints no longer satisfy pyproject.toml.
RUN pip install --no-deps . && pip check && rm -rf /app/build \
    && groupadd --system --gid 10001 broker \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin broker
USER 10001

# Inside a container the broker listens on every interface; the load balancer is in front.
ENV MCP_BROKER_HOST=0.0.0.0 MCP_BROKER_PORT=8080
# Which Host names the broker answers to (others get 421): binding every interface, it would
# otherwise answer to any, and a web page on a DNS-rebound name could read every record.
# Loopback names suit `docker run -p 8080:8080`; set the names your clients use, e.g.
#   -e MCP_BROKER_ALLOWED_HOSTS='["broker.example.com"]'   (or set MCP_BROKER_API_KEYS).
ENV MCP_BROKER_ALLOWED_HOSTS='["localhost","127.0.0.1","[::1]"]'
EXPOSE 8080
# SIGTERM drains: legacy streams end with retry:, listens get their complete result, new
# connections are refused, and for up to MCP_BROKER_SHUTDOWN_DRAIN seconds the requests on open
# connections are answered with Connection: close. A load balancer must close idle connections
# sooner than both that and MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT (deploy/nginx.conf: 3 s).
# Behind a balancer that polls /readyz (Kubernetes), also set MCP_BROKER_READINESS_DELAY: the
# seconds between SIGTERM and the streams ending while /readyz already answers 503.
ENV MCP_BROKER_SHUTDOWN_DRAIN=5 MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT=5
STOPSIGNAL SIGTERM
# Liveness: /livez answers 200 without asking Redis, whatever the Host header, so a Redis outage
# never marks every worker unhealthy at once. (Readiness is /readyz: 503 while Redis is away or
# the worker drains; docker-compose.yml uses that one to order the load balancer's start.)
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('MCP_BROKER_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["mcp-broker"]
CMD ["serve"]
