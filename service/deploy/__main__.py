"""`python -m service.deploy`: plan the instances, start them and Nginx, run until SIGTERM/SIGINT.

The Docker entrypoint and `make run`. Settings come from the environment (service/settings.py):
INSTANCES, NGINX_LISTEN, PROXY_READ_TIMEOUT, HOST/PORT (instance i listens on PORT+i), and the rest
as for one instance."""

import logging
import sys

from ..settings import load_settings
from .planning import plan_instances
from .supervisor import Deployment


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings()
    return Deployment(settings, plan_instances(settings)).run()


sys.exit(main())
