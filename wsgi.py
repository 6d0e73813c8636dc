"""WSGI entry point: `gunicorn -c gunicorn.conf.py wsgi:app`. Settings come from the environment."""

from service.api import create_app
from service.settings import load_settings

app = create_app(load_settings())
