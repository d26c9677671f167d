"""The deployment files under deploy/ agree with the broker and with the Kubernetes API, offline.

deploy/kubernetes: every manifest validates against the Kubernetes API schemas of a fixed
version (kubernetes-validate ships them), the kustomization lists each of them, the probes and
the shutdown timings fit what the broker does on SIGTERM, and every ``MCP_BROKER_*`` name is a
setting (any other stops the broker at start). deploy/grafana and deploy/prometheus: every
metric they query is in ``broker.metrics.CATALOG`` or is a worker's process figure (``RUNTIME``),
with its labels, and the rules file has the shape Prometheus loads. No network, no cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from broker.config import Settings
from broker.metrics import CATALOG, Instrument
from broker.ops.prometheus import PrometheusMetrics
from tests.support import ROOT

#: The Kubernetes version the manifests are validated against (strict: unknown fields fail).
KUBERNETES_VERSION = "1.34.0"

KUBERNETES = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "mcp-broker.json"
RULES = ROOT / "deploy" / "prometheus" / "mcp-broker-rules.yaml"

#: Seconds a worker may still need after the graceful timeout: the lifespan shutdown (fan-out's
#: batch in hand, at most MCP_BROKER_FANOUT_STOP_TIMEOUT, within the 5 s it waits for its tasks).
LIFESPAN_SHUTDOWN = 5.0
#: ingress-nginx's upstream-keepalive-timeout (its default): the balancer must close idle
#: connections to the workers before they do, and the drain must outlast it
#: (deploy/kubernetes/README.md, "Shutdown"). Lower it here only with the controller's setting.
INGRESS_UPSTREAM_IDLE_TIMEOUT = 60.0

SETTINGS = {"MCP_BROKER_" + name.upper() for name in Settings.model_fields}
SETTING_NAME = re.compile(r"MCP_BROKER_[A-Z0-9_]+")
#: Labels Prometheus adds to every scraped series (and the usual Kubernetes relabelings).
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
#: The process and runtime figures of prometheus_client's collectors (``broker.ops.process_metrics``);
#: ``pid`` tells the workers of ``serve --workers N`` apart.
RUNTIME = {
    "process_resident_memory_bytes": Instrument("gauge", "", ("pid",)),
    "process_virtual_memory_bytes": Instrument("gauge", "", ("pid",)),
    "process_cpu_seconds_total": Instrument("counter", "", ("pid",)),
    "process_open_fds": Instrument("gauge", "", ("pid",)),
    "process_max_fds": Instrument("gauge", "", ("pid",)),
    "process_start_time_seconds": Instrument("gauge", "", ("pid",)),
    "python_gc_collections_total": Instrument("counter", "", ("generation", "pid")),
    "python_gc_objects_collected_total": Instrument("counter", "", ("generation", "pid")),
    "python_gc_objects_uncollectable_total": Instrument("counter", "", ("generation", "pid")),
}
KNOWN = {**CATALOG, **RUNTIME}


# -- loading ---------------------------------------------------------------------------------------------

def manifest_files() -> list[Path]:
    return sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_documents() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in documents(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/kubernetes, found {len(found)}"
    return found[0]


def broker_deployment() -> dict[str, Any]:
    return find("Deployment", "mcp-broker")


def broker_container() -> dict[str, Any]:
    containers = broker_deployment()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per broker pod"
    container: dict[str, Any] = containers[0]
    return container


def container_env() -> dict[str, str]:
    """The ``env`` of the broker's container (literal values only)."""
    return {item["name"]: item["value"] for item in broker_container().get("env", []) if "value" in item}


def strings(node: Any) -> Iterator[str]:
    """Every key and string value of a loaded YAML/JSON tree (comments are not in it)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)
    elif isinstance(node, str):
        yield node


# -- Kubernetes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no manifest"
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(part) for part in exc.absolute_path)
            problems.append(f"{doc['kind']} {doc['metadata'].get('name')}: {where}: {exc.message}")
    assert not problems, f"{path.name} against Kubernetes {KUBERNETES_VERSION}: {problems}"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource listed twice"
    assert set(listed) == {p.name for p in manifest_files()}
    images = {image["name"] for image in kustomization.get("images", [])}
    assert broker_container()["image"].partition(":")[0] in images, "the image is set in one place: images:"


def test_probes_use_livez_for_liveness_and_readyz_for_readiness() -> None:
    container = broker_container()
    port = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # /livez asks nothing of Redis: a Redis outage must not restart the workers (/healthz would).
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    if "startupProbe" in container:
        assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in container:
            target = container[probe]["httpGet"]["port"]
            assert port.get(target, target) == 8080, f"{probe} asks another port than the broker's"
    args = container["args"]
    assert args[0] == "serve" and args[args.index("--port") + 1] == "8080"
    assert "--workers" not in args, "one worker process per pod: scale with replicas"


def test_grace_period_covers_readiness_delay_drain_and_graceful_timeout() -> None:
    pod = broker_deployment()["spec"]["template"]["spec"]
    env = container_env()
    needed = [
        "MCP_BROKER_READINESS_DELAY", "MCP_BROKER_SHUTDOWN_DRAIN", "MCP_BROKER_GRACEFUL_TIMEOUT",
        "MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT",
    ]
    missing = [name for name in needed if name not in env]
    assert not missing, f"set {missing} in the Deployment's env, next to terminationGracePeriodSeconds"
    delay, drain, graceful, keepalive = (float(env[name]) for name in needed)
    assert delay > 0, "without a readiness delay streams end before the endpoint is removed"
    pre_stop = broker_container().get("lifecycle", {}).get("preStop", {})
    hook = float(pre_stop.get("sleep", {}).get("seconds", 0))  # the kubelet's sleep runs before SIGTERM
    assert set(pre_stop) <= {"sleep"}, "only a sleep preStop hook is accounted for here"
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= hook + delay + drain + graceful + LIFESPAN_SHUTDOWN, (
        f"terminationGracePeriodSeconds {grace} < preStop {hook} + readiness delay {delay} + drain {drain}"
        f" + graceful timeout {graceful} + lifespan shutdown {LIFESPAN_SHUTDOWN}: the kubelet would kill it mid-drain")
    # The balancer, not the worker, closes idle connections; and the drain outlasts its idle timeout.
    assert keepalive > INGRESS_UPSTREAM_IDLE_TIMEOUT
    assert drain > INGRESS_UPSTREAM_IDLE_TIMEOUT


def test_security_context_is_restricted() -> None:
    pod = broker_deployment()["spec"]["template"]["spec"]
    container = broker_container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert isinstance(pod["securityContext"].get("runAsUser"), int), "numeric, so runAsNonRoot can be checked"
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert "/tmp" in mounts, "a writable temp dir (multi-process metrics, tempfile)"
    assert "memory" in container["resources"]["limits"] and "cpu" in container["resources"]["requests"]


def test_every_mcp_broker_name_is_a_setting() -> None:
    found = {name for doc in all_documents() for text in strings(doc) for name in SETTING_NAME.findall(text)}
    assert found, "no MCP_BROKER_ setting found in the manifests"
    unknown = sorted(found - SETTINGS)
    assert not unknown, f"not settings (the broker would refuse to start): {unknown}"


def test_no_setting_is_defined_twice() -> None:
    config = find("ConfigMap", "mcp-broker-config")["data"]
    secret = find("Secret", "mcp-broker-secrets").get("stringData", {})
    env = [item["name"] for item in broker_container().get("env", [])]
    assert len(env) == len(set(env))
    places = [set(config), set(secret), set(env)]
    for i, first in enumerate(places):
        for second in places[i + 1:]:
            assert not first & second, f"set in two places (env wins over envFrom): {sorted(first & second)}"


def test_the_settings_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigMap, the Secret's placeholders and the env together make Settings the broker accepts."""
    import os

    for name in list(os.environ):
        if name.startswith("MCP_BROKER_"):
            monkeypatch.delenv(name)
    values = {
        **find("ConfigMap", "mcp-broker-config")["data"],
        **find("Secret", "mcp-broker-secrets").get("stringData", {}),
        **container_env(),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.redis_url, "the Redis backend: workers share their state"
    assert settings.allowed_hosts, "name the ingress host (DNS rebinding)"
    ingress_hosts = {rule["host"] for rule in find("Ingress", "mcp-broker")["spec"]["rules"]}
    assert ingress_hosts <= set(settings.allowed_hosts), "the ingress host is not in MCP_BROKER_ALLOWED_HOSTS (421)"


def test_service_links_do_not_inject_mcp_broker_variables() -> None:
    """Kubernetes puts <SERVICE>_SERVICE_HOST, <SERVICE>_PORT... into pods: for the Service mcp-broker, not settings."""
    clashing = [d["metadata"]["name"] for d in all_documents()
                if d["kind"] == "Service" and d["metadata"]["name"].upper().replace("-", "_").startswith("MCP_BROKER")]
    if clashing:
        assert broker_deployment()["spec"]["template"]["spec"].get("enableServiceLinks") is False, clashing


def test_the_manifests_refer_to_each_other() -> None:
    deployment = broker_deployment()
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns replicas"
    for source in broker_container()["envFrom"]:
        if "configMapRef" in source:
            find("ConfigMap", source["configMapRef"]["name"])
        else:
            find("Secret", source["secretRef"]["name"])
    service = find("Service", "mcp-broker")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"].get("sessionAffinity", "None") == "None", "no sticky sessions"
    assert find("PodDisruptionBudget", "mcp-broker")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    target = find("HorizontalPodAutoscaler", "mcp-broker")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "mcp-broker")
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for rule in find("Ingress", "mcp-broker")["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == "mcp-broker" and backend["port"]["name"] in port_names


def test_ingress_passes_sse_at_once_and_keeps_streams_open() -> None:
    annotations = find("Ingress", "mcp-broker")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "proxy-buffering"] == "off"
    keepalive_interval = Settings.model_fields["keepalive_interval"].default
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[prefix + timeout]) >= 60 * keepalive_interval, timeout
    assert not any("affinity" in key or "upstream-hash-by" in key for key in annotations), "no sticky sessions"
    assert "timeout" not in annotations.get(prefix + "proxy-next-upstream", ""), "never resend a POST that was sent"


def test_secret_holds_placeholders_only() -> None:
    keys = json.loads(find("Secret", "mcp-broker-secrets")["stringData"]["MCP_BROKER_API_KEYS"])
    assert keys and all("REPLACE" in key for key in keys), "a placeholder, never a real key"


# -- metrics ---------------------------------------------------------------------------------------------

def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard["panels"])
    return exprs


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def base_name(metric: str) -> str:
    """The CATALOG or RUNTIME name a series belongs to (a histogram's _bucket, _sum and _count are its own)."""
    if metric in KNOWN:
        return metric
    for suffix in HISTOGRAM_SUFFIXES:
        base = metric.removesuffix(suffix)
        if base != metric and base in KNOWN and KNOWN[base].kind == "histogram":
            return base
    raise AssertionError(f"{metric} is not in broker.metrics.CATALOG nor a process figure")


def check_expr(expr: str) -> set[str]:
    """The CATALOG and RUNTIME names ``expr`` uses, after checking their names, labels and functions."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth: list[str] = []
    for char in re.sub(r'"[^"]*"', '""', expr):
        if char in pairs:
            depth.append(pairs[char])
        elif char in pairs.values():
            assert depth and depth.pop() == char, f"unbalanced {char!r} in {expr!r}"
    assert not depth, f"unclosed {depth} in {expr!r}"
    used: set[str] = set()
    for match in re.finditer(r"\b((?:mcp_broker|mcp_server|process|python_gc)_[a-z0-9_]+)(\{[^}]*\})?", expr):
        metric, selector = match.group(1), match.group(2) or ""
        base = base_name(metric)
        used.add(base)
        instrument = KNOWN[base]
        assert not (instrument.kind == "histogram" and metric == base), f"{metric}: query _bucket, _sum or _count"
        if instrument.kind == "counter" or metric != base:
            before = expr[:match.start()].rstrip()
            assert re.search(r"\b(rate|irate|increase)\($", before), f"{metric} only grows: rate() or increase() it"
        allowed = set(instrument.labels) | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector):
            assert label in allowed, f"{metric} has no label {label!r} (it has {sorted(instrument.labels)})"
    known = TARGET_LABELS | {label for base in used for label in KNOWN[base].labels}
    if re.search(r"_bucket\b", expr):
        known.add("le")
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            assert label in known, f"{label!r} is no label of the metrics in {expr!r}"
    return used


def test_dashboard_queries_only_catalog_metrics() -> None:
    exprs = dashboard_exprs()
    assert exprs
    used = {base for expr in exprs for base in check_expr(expr)}
    for wanted in ("mcp_broker_streams_open", "mcp_broker_notifications_sent_total",
                   "mcp_broker_publish_to_frame_seconds", "mcp_broker_fanout_batch_seconds",
                   "mcp_broker_changelog_lag_entries", "mcp_broker_http_answers_total",
                   "mcp_broker_changes_refused_total", "mcp_broker_pubsub_reconnects_total",
                   "mcp_broker_backend_outage_seconds_total", "mcp_broker_sessions_open"):
        assert wanted in used, f"the dashboard shows no {wanted}"
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        for metric in re.findall(r"\bmcp_broker_[a-z0-9_]+", json.dumps(variable)):
            base_name(metric)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]


def test_the_process_figures_the_deploy_files_may_query_are_exposed() -> None:
    text = PrometheusMetrics().render()[0].decode()
    for name in RUNTIME:
        assert f"\n{name}" in text or f"\n{name}{{" in text or text.startswith(name), name


def test_rules_have_the_shape_prometheus_loads() -> None:
    loaded = yaml.safe_load(RULES.read_text())
    assert set(loaded) == {"groups"} and loaded["groups"]
    names: list[str] = []
    for group in loaded["groups"]:
        assert isinstance(group["name"], str) and group["rules"]
        assert set(group) <= {"name", "interval", "limit", "rules", "labels", "query_offset"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"]), rule["alert"]
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", str(rule["for"])), rule["for"]
            assert rule["labels"]["severity"] in {"critical", "warning"}
            assert all(isinstance(v, str) for v in rule["labels"].values())
            assert {"summary", "description"} <= set(rule["annotations"])
            names.append(rule["alert"])
    assert len(names) == len(set(names)), "alert names repeat"


def test_rules_query_only_catalog_metrics_and_cover_the_guarantees() -> None:
    used: set[str] = set()
    for rule in rules():
        used |= check_expr(rule["expr"])
    for wanted in ("mcp_broker_backend_outage_seconds_total", "mcp_broker_changelog_lag_entries",
                   "mcp_broker_changes_refused_total", "mcp_broker_fanout_leases_held",
                   "mcp_broker_backend_data_losses_total", "mcp_broker_fanout_dropped_batches_total",
                   "mcp_broker_pubsub_reconnects_total", "mcp_broker_http_answers_total"):
        assert wanted in used, f"no alert on {wanted}"
    text = " ".join(rule["expr"] for rule in rules())
    for reason in ("log_full", "tenant_quota"):
        assert f'reason="{reason}"' in text, f"no alert on refusals for {reason}"
