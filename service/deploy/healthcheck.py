"""`python -m service.deploy.healthcheck`: exit 0 when the service behind Nginx (NGINX_LISTEN) is
ready, else 1: the Docker HEALTHCHECK (/ready needs no API key)."""

import sys

from ..settings import load_settings
from .supervisor import client_url, get_status


def main() -> int:
    settings = load_settings()
    status, _ = get_status(client_url(settings.nginx_listen) + "/ready")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
