"""The many-machine shape on Kubernetes, written from the same place as the local deployment's proxy:
`python -m service.deploy.kubernetes --replicas N --out ops/kubernetes` writes

- qwen3vl.yaml: the instances — a StatefulSet (pods qwen3vl-0 … qwen3vl-N-1, each one Gunicorn
  instance on its pod's cores with a CACHE_DIR of its own) and the headless Service that names each
  pod (`qwen3vl-0.qwen3vl-pods`), with their settings;
- proxy.yaml: the front — Nginx with affinity.js, its configuration rendered by nginx.py for those pod
  names (the same template `python -m service.deploy` runs), and the Service clients reach;
- redis.yaml: the one Redis (appendonly) behind the job store and the shared state.

The proxy lists the pods by name, so a change of --replicas is a change of the proxy's configuration:
write the manifests again and apply both (no autoscaler: consistent hashing moves only the conversations
of the pods that come or go). Nginx resolves the names when it starts; the proxy's container reloads it
when a pod comes back with another address. tests/test_ops.py checks the files equal this output and
validates them against Kubernetes' schemas.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from ..settings import Settings
from .nginx import AFFINITY_SCRIPT, nginx_config

APP, PODS, PROXY, REDIS = "qwen3vl", "qwen3vl-pods", "qwen3vl-proxy", "qwen3vl-redis"
IMAGE = "qwen3vl-cpu:latest"  # docker build -t qwen3vl-cpu . (Nginx, its njs module and the service)
PORT, PROXY_PORT, REDIS_PORT = 8000, 8080, 6379
CORES, MEMORY = "2", "6Gi"  # one pod's: its THREADS follow the cores
CONFIG_DIR, RUN_DIR = "/etc/qwen3vl-proxy", "/tmp/qwen3vl-proxy"
HEADER = "# Written by `python -m service.deploy.kubernetes --replicas {replicas}` (service/deploy/kubernetes.py).\n"

SETTINGS = {
    "MODEL_PATH": "/models/Qwen3-VL-2B-Instruct",
    "CACHE_DIR": "/cache",  # the pod's own volume: kernels, the disk tier
    "HOST": "0.0.0.0",
    "PORT": str(PORT),
    "THREADS": CORES,
    "MAX_BATCH_SIZE": "4",
    "QUEUE_SIZE": "8",
    "JOB_STORE_URL": f"redis://{REDIS}:{REDIS_PORT}/0",  # batch lines, and (SHARED_STATE) conversations
    "SHARED_STATE": "true",
    "BATCH_PRIORITY": "10",
    "BATCH_LEASE_SECONDS": "60",
    "GRACEFUL_TIMEOUT": "30",
}


def _probe(path: str, **timing) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def instances(replicas: int) -> list[dict]:
    """The settings, the StatefulSet of instances and the headless Service naming each pod."""
    labels = {"app": APP}
    container = {
        "name": APP,
        "image": IMAGE,
        "command": ["python", "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"],
        "envFrom": [{"configMapRef": {"name": f"{APP}-settings"}}],
        "ports": [{"name": "http", "containerPort": PORT}],
        "resources": {"requests": {"cpu": CORES, "memory": MEMORY}, "limits": {"cpu": CORES, "memory": MEMORY}},
        "startupProbe": _probe("/health", periodSeconds=5, failureThreshold=180),
        "readinessProbe": _probe("/ready", periodSeconds=5),
        "livenessProbe": _probe("/health", periodSeconds=20, timeoutSeconds=5),
        "volumeMounts": [
            {"name": "models", "mountPath": "/models", "readOnly": True},
            {"name": "cache", "mountPath": "/cache"},
        ],
    }
    pod = {
        "metadata": {
            "labels": labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": {
            "terminationGracePeriodSeconds": 40,  # GRACEFUL_TIMEOUT and a margin
            "containers": [container],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": f"{APP}-models", "readOnly": True}}],
        },
    }
    cache_claim = {
        "metadata": {"name": "cache"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}},
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{APP}-settings"}, "data": SETTINGS},
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": APP, "labels": labels},
            "spec": {
                "serviceName": PODS,
                "replicas": replicas,
                "podManagementPolicy": "Parallel",  # every pod loads its model at once
                "selector": {"matchLabels": labels},
                "template": pod,
                "volumeClaimTemplates": [cache_claim],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": PODS, "labels": labels},
            "spec": {
                "clusterIP": "None",  # headless: each pod by its name, for the proxy
                "publishNotReadyAddresses": True,  # named while loading: the proxy starts, Nginx skips a 503
                "selector": labels,
                "ports": [{"name": "http", "port": PORT, "targetPort": "http"}],
            },
        },
    ]


def pod_addresses(replicas: int) -> list[str]:
    return [f"{APP}-{i}.{PODS}:{PORT}" for i in range(replicas)]


def proxy_configuration(replicas: int) -> str:
    """nginx.conf for the proxy pod: the deployment's template, the pods by name."""
    settings = Settings.model_validate({"nginx_listen": f"0.0.0.0:{PROXY_PORT}"})  # the defaults, not this shell's
    return nginx_config(
        settings,
        pod_addresses(replicas),
        Path(RUN_DIR),
        "/dev/stdout",
        settings.graceful_timeout,
        module="/usr/lib/nginx/modules/ngx_http_js_module.so",  # Debian's, in the image
        script=f"{CONFIG_DIR}/{AFFINITY_SCRIPT.name}",
    )


# Nginx resolves the pods' names when it starts: reload it when one comes back at another address.
RELOAD_ON_NEW_ADDRESSES = """\
names="{names}"
addresses() {{ for n in $names; do getent hosts "$n"; done | sort; }}
nginx -p {run} -e stderr -c {config}/nginx.conf &
nginx=$!
known=$(addresses)
while kill -0 "$nginx" 2>/dev/null; do
  sleep 5
  now=$(addresses)
  if [ "$now" != "$known" ]; then nginx -p {run} -e stderr -c {config}/nginx.conf -s reload; known=$now; fi
done
wait "$nginx"
"""


def proxy(replicas: int) -> list[dict]:
    """The proxy's configuration (nginx.conf, affinity.js), its Deployment and the Service clients reach."""
    labels = {"app": PROXY}
    names = " ".join(address.rsplit(":", 1)[0] for address in pod_addresses(replicas))
    script = RELOAD_ON_NEW_ADDRESSES.format(names=names, run=RUN_DIR, config=CONFIG_DIR)
    container = {
        "name": "nginx",
        "image": IMAGE,
        "command": ["sh", "-c", script],
        "ports": [{"name": "http", "containerPort": PROXY_PORT}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 20},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR}, {"name": "run", "mountPath": RUN_DIR}],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": PROXY},
            "data": {"nginx.conf": proxy_configuration(replicas), AFFINITY_SCRIPT.name: AFFINITY_SCRIPT.read_text()},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": PROXY, "labels": labels},
            "spec": {
                "replicas": 2,  # both route alike: the key and the hash ring are the same in each
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "terminationGracePeriodSeconds": 40,
                        "containers": [container],
                        "volumes": [{"name": "config", "configMap": {"name": PROXY}}, {"name": "run", "emptyDir": {}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": APP},
            "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
    ]


def redis() -> list[dict]:
    """One Redis for the job store and the shared state: appendonly, so a restart loses nothing."""
    labels = {"app": REDIS}
    container = {
        "name": "redis",
        "image": "redis:7",
        "args": ["--appendonly", "yes", "--appendfsync", "everysec"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    data_claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}},
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": REDIS, "labels": labels},
            "spec": {
                "serviceName": REDIS,
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
                "volumeClaimTemplates": [data_claim],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": REDIS},
            "spec": {"selector": labels, "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}]},
        },
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (nginx.conf, affinity.js, the proxy's script) as literal blocks, readable."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def manifests(replicas: int) -> dict[str, str]:
    """File name → its YAML (several documents each)."""
    header = HEADER.format(replicas=replicas)

    def dump(docs: list[dict]) -> str:
        return header + "---\n".join(
            yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True) for d in docs
        )

    return {"qwen3vl.yaml": dump(instances(replicas)), "proxy.yaml": dump(proxy(replicas)), "redis.yaml": dump(redis())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.deploy.kubernetes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3, help="instance pods (each one Gunicorn instance)")
    parser.add_argument("--out", type=Path, default=Path("ops/kubernetes"), help="the folder the files go to")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in manifests(args.replicas).items():
        (args.out / name).write_text(text)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
