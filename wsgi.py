"""WSGI entry point: `gunicorn -c gunicorn.conf.py wsgi:app`. Settings come from the environment."""

from service.api import create_app
from service.settings import load_settings

settings = load_settings()
# With PRELOAD (default) Gunicorn imports this in its master, which loads the model and forks the worker.
app = create_app(settings, load="before_fork" if settings.preload_in_master else "background")
