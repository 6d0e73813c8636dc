"""The production shape on one machine: Nginx in front of Gunicorn instances pinned to disjoint
cores (`planning`: how many, which cores, what memory each; `supervisor`: starting, watching and
restarting them; `nginx`: its configuration; `healthcheck`), run by `__main__` (`python -m
service.deploy`). It runs the service as processes: it imports only the settings and the memory
budget, never the engine or the HTTP layer.
"""
