"""What ops/ ships — the Grafana dashboard, the Prometheus alert rules, the Kubernetes manifests —
names only what exists: every metric on a real server's /metrics, every setting in the settings
object, the ports and probe paths the container and the app serve, the Redis the jobs use; and the
manifests are what `python -m service.deploy.kubernetes` writes, valid against Kubernetes' schemas."""

from __future__ import annotations

import json
import re

import pytest
import requests
import yaml

from service.settings import Settings

from conftest import ROOT

OPS = ROOT / "ops"
METRIC = re.compile(r"\bqwen3vl_[a-z0-9_]+")


def manifests() -> list[dict]:
    return [doc for path in sorted((OPS / "kubernetes").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


def named(kind: str, name: str) -> dict:
    [doc] = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def dashboard_expressions() -> list[str]:
    board = json.loads((OPS / "grafana" / "qwen3vl-dashboard.json").read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def alert_expressions() -> list[str]:
    rules = yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def names_on(base: str) -> set[str]:
    """The metric names a server exposes once it has answered a request."""
    answer = requests.post(base + "/v1/chat", json={"prompt": "Hi.", "max_tokens": 2, "stream": False})
    answer.raise_for_status()
    text = requests.get(base + "/metrics").text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def exposed(shared_server, serve, redis_url) -> set[str]:
    """The metric names servers expose: the shared one, and one whose JOB_STORE_URL is Redis (the shared
    state's and affinity's metrics are there)."""
    with serve({"JOB_STORE_URL": redis_url}, "ops-redis") as (with_redis, _):
        return names_on(shared_server) | names_on(with_redis)


def test_every_metric_the_dashboard_and_alerts_name_is_on_metrics(exposed):
    expressions = dashboard_expressions() + alert_expressions()
    assert len(expressions) >= 15
    names = {name for expr in expressions for name in METRIC.findall(expr)}
    assert names - exposed == set()


def test_the_manifests_set_only_settings_that_exist_and_the_job_store_they_deploy():
    settings = {name.upper() for name in Settings.model_fields}
    config = named("ConfigMap", "qwen3vl-settings")["data"]
    assert set(config) - settings == set()
    redis = named("Service", "qwen3vl-redis")
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", config["JOB_STORE_URL"]).groups()
    assert host == redis["metadata"]["name"] and int(port) == redis["spec"]["ports"][0]["port"]
    Settings(**{k.lower(): v for k, v in config.items() if k not in ("MODEL_PATH", "CACHE_DIR")})  # valid values


def test_the_ports_and_probes_are_the_containers_and_the_apps(shared_server):
    container = named("StatefulSet", "qwen3vl")["spec"]["template"]["spec"]["containers"][0]
    [port] = container["ports"]
    assert int(named("ConfigMap", "qwen3vl-settings")["data"]["PORT"]) == port["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert container[probe]["httpGet"]["port"] == port["name"]
        assert requests.get(shared_server + path).status_code == 200, path
    pods = named("Service", "qwen3vl-pods")
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["ports"][0]["port"] == port["containerPort"]
    assert named("StatefulSet", "qwen3vl")["spec"]["serviceName"] == "qwen3vl-pods"
    # the proxy: Nginx listens where its container and the Dockerfile say, and lists each pod by name
    proxy = named("Deployment", "qwen3vl-proxy")["spec"]["template"]["spec"]["containers"][0]
    config = named("ConfigMap", "qwen3vl-proxy")["data"]["nginx.conf"]
    [proxy_port] = proxy["ports"]
    assert f"listen 0.0.0.0:{proxy_port['containerPort']};" in config
    assert f"EXPOSE {proxy_port['containerPort']}" in (ROOT / "Dockerfile").read_text()
    replicas = named("StatefulSet", "qwen3vl")["spec"]["replicas"]
    for i in range(replicas):
        assert f"server qwen3vl-{i}.qwen3vl-pods:{port['containerPort']} " in config
    assert named("Service", "qwen3vl")["spec"]["selector"] == {"app": "qwen3vl-proxy"}


def test_the_manifests_are_what_service_deploy_writes(tmp_path):
    """One place: the files are the generator's output (its proxy configuration the deployment's
    template rendered for the pods), so the proxy and the manifests cannot drift apart."""
    from service.deploy.kubernetes import main

    replicas = named("StatefulSet", "qwen3vl")["spec"]["replicas"]
    assert main(["--replicas", str(replicas), "--out", str(tmp_path)]) == 0
    for path in sorted((OPS / "kubernetes").glob("*.yaml")):
        assert path.read_text() == (tmp_path / path.name).read_text(), (
            f"{path.name}: run python -m service.deploy.kubernetes"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (OPS / "kubernetes").glob("*.yaml"))
    script = named("ConfigMap", "qwen3vl-proxy")["data"]["affinity.js"]
    assert script == (ROOT / "nginx" / "affinity.js").read_text()


def test_the_manifests_are_valid_kubernetes_objects_strictly():
    """Each object against the schemas of Kubernetes (kubernetes-validate, offline; strict: a key the
    schema does not know is an error, not ignored)."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for doc in manifests():
        kubernetes_validate.validate(doc, version, strict=True)
    broken = {
        **named("Service", "qwen3vl-pods"),
        "spec": {**named("Service", "qwen3vl-pods")["spec"], "clusterIp": "None"},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_usable_gauges_are_1_where_the_disk_tier_and_the_job_store_serve(exposed, shared_server):
    """The gauges Qwen3VLDiskTierOff and Qwen3VLJobStoreDown fire on at 0 read 1 on a healthy server
    (the disk tier's read 0 everywhere: the Gunicorn master's untouched 0 won the minimum over the
    live processes)."""
    lines = requests.get(shared_server + "/metrics").text.splitlines()
    assert "qwen3vl_kv_disk_usable 1.0" in lines and "qwen3vl_job_store_usable 1.0" in lines
