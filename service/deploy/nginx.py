"""Render nginx/nginx.conf.template for a set of instances (beside it nginx/affinity.js, which routes each
conversation to its instance), and start Nginx on it."""

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
AFFINITY_SCRIPT = ROOT / "nginx" / "affinity.js"
# Where Debian's libnginx-mod-http-js puts the njs module (the official nginx image links /etc/nginx/modules
# to the same folder).
JS_MODULE_PLACES = ("/usr/lib/nginx/modules", "/usr/share/nginx/modules", "/etc/nginx/modules")
JS_MODULE = "ngx_http_js_module.so"
BALANCE = {"affinity": "hash $affinity_key consistent;", "round-robin": "# round-robin: Nginx's default"}
_FIELD = re.compile(r"\{\{([A-Z_]+)\}\}")


def render(template: str, values: dict[str, str]) -> str:
    """Fill each {{NAME}} of `template`; a name without a value is an error, not an empty string."""
    missing = sorted(set(_FIELD.findall(template)) - set(values))
    if missing:
        raise KeyError(f"no value for template field(s) {', '.join(missing)}")
    return _FIELD.sub(lambda m: str(values[m.group(1)]), template)


def _seconds(value: float) -> str:
    return f"{round(value * 1000)}ms"  # Nginx time units: milliseconds keep sub-second test settings exact


def js_module() -> str:
    """The njs module's path (Debian's libnginx-mod-http-js), which affinity.js runs in."""
    for place in JS_MODULE_PLACES:
        if (Path(place) / JS_MODULE).is_file():
            return str(Path(place) / JS_MODULE)
    raise SettingsError(
        "Nginx's njs module is not installed: apt-get install libnginx-mod-http-js (`make nginx` does it as root)"
    )


def nginx_config(
    settings: Settings,
    instances: Iterable[str | Instance],
    run_dir: Path,
    access_log: str = "/dev/stdout",
    graceful_timeout: float = 30,
    module: str | None = None,
    script: str | None = None,
    balance: str = "affinity",
) -> str:
    """The Nginx configuration that fronts `instances` (Instances, or "host:port" addresses) with the
    given settings; `module`: the njs module's path (default: this machine's), `script`: where
    affinity.js will be (default: in `run_dir`, where write_config puts it); `balance`: "affinity" (each
    conversation to its instance) or "round-robin" (bench_cluster's comparison)."""
    if balance not in BALANCE:
        raise ValueError(f"balance is affinity or round-robin, not {balance!r}")
    addresses = [i if isinstance(i, str) else i.address for i in instances]
    servers = "\n".join(f"        server {address} max_fails=1 fail_timeout=5s;" for address in addresses)
    return render(
        TEMPLATE.read_text(),
        {
            "JS_MODULE": module or js_module(),
            "AFFINITY_SCRIPT": script or str(Path(run_dir) / AFFINITY_SCRIPT.name),
            "RUN_DIR": str(run_dir),
            "BALANCE": BALANCE[balance],
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
    """Write `config` and affinity.js into `run_dir` and have Nginx check them; a bad config fails here,
    readably."""
    path = run_dir / "nginx.conf"
    path.write_text(config)
    shutil.copyfile(AFFINITY_SCRIPT, run_dir / AFFINITY_SCRIPT.name)
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
