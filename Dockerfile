# mcp-broker: one image for HTTP workers (`serve`) and the stand-alone fan-out (`fanout`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
RUN pip install . && useradd --system --uid 10001 broker
USER broker

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
ENV MCP_BROKER_SHUTDOWN_DRAIN=5 MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT=5
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcp-broker"]
CMD ["serve"]
