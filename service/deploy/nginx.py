"""Render nginx/nginx.conf.template for a set of instances, and start Nginx on it."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from ..settings import Settings, SettingsError
from .planning import Instance

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "nginx" / "nginx.conf.template"
_FIELD = re.compile(r"\{\{([A-Z_]+)\}\}")


def render(template: str, values: dict[str, str]) -> str:
    """Fill each {{NAME}} of `template`; a name without a value is an error, not an empty string."""
    missing = sorted(set(_FIELD.findall(template)) - set(values))
    if missing:
        raise KeyError(f"no value for template field(s) {', '.join(missing)}")
    return _FIELD.sub(lambda m: str(values[m.group(1)]), template)


def _seconds(value: float) -> str:
    return f"{round(value * 1000)}ms"  # Nginx time units: milliseconds keep sub-second test settings exact


def nginx_config(
    settings: Settings,
    instances: Iterable[Instance],
    run_dir: Path,
    access_log: str = "/dev/stdout",
    graceful_timeout: float = 30,
) -> str:
    """The Nginx configuration that fronts `instances` with the given settings."""
    servers = "\n".join(f"        server {i.address} max_fails=1 fail_timeout=5s;" for i in instances)
    return render(
        TEMPLATE.read_text(),
        {
            "RUN_DIR": str(run_dir),
            "ACCESS_LOG": access_log,
            "UPSTREAM_SERVERS": servers,
            "LISTEN": settings.nginx_listen,
            "MAX_BODY_BYTES": str(settings.max_body_bytes),
            "BATCH_UPLOAD_BYTES": str(settings.batch_upload_bytes),
            "PROXY_READ_TIMEOUT": _seconds(settings.proxy_read_timeout),
            "GRACEFUL_TIMEOUT": str(max(1, round(graceful_timeout))),
        },
    )


def nginx_binary() -> str:
    """Nginx's path (Debian puts it in /usr/sbin, outside a normal user's PATH)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if not found:
        raise SettingsError("nginx is not installed: apt-get install nginx (`make run` does it when run as root)")
    return found


def write_config(config: str, run_dir: Path) -> Path:
    """Write `config` into `run_dir` and have Nginx check it; a bad config fails here, readably."""
    path = run_dir / "nginx.conf"
    path.write_text(config)
    check = subprocess.run(
        [nginx_binary(), "-t", "-q", "-p", str(run_dir), "-e", "stderr", "-c", str(path)],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise SettingsError(f"the Nginx configuration {path} is invalid:\n{check.stderr.strip()}")
    return path


def start_nginx(config_path: Path, run_dir: Path, **popen) -> subprocess.Popen:
    """Nginx in the foreground (`daemon off` in the config), in its own session, on `config_path`."""
    return subprocess.Popen(
        [nginx_binary(), "-p", str(run_dir), "-e", "stderr", "-c", str(config_path)], start_new_session=True, **popen
    )
