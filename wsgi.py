"""WSGI entry point: `gunicorn -c gunicorn.conf.py wsgi:app`. Settings come from the environment."""

from service import native, startup
from service.settings import load_settings

settings = load_settings()
native.prebuild(settings.cache_dir)  # gcc builds the kernels (first start) while torch imports

from service.api import create_app  # noqa: E402  (after the kernels' build has begun)

startup.mark("imports")

# With PRELOAD (default) Gunicorn imports this in its master, which loads the model and forks the worker.
app = create_app(settings, load="before_fork" if settings.preload_in_master else "background")
