"""The production shape: on one machine, Nginx in front of Gunicorn instances pinned to disjoint cores
(`planning`: how many, which cores, what memory each; `supervisor`: starting, watching and restarting
them; `nginx`: its configuration, with nginx/affinity.js keeping each conversation on its instance;
`healthcheck`), run by `__main__` (`python -m service.deploy`); on many machines, the Kubernetes
manifests of instances, proxy and Redis, written from the same configuration (`kubernetes`). It runs
the service as processes: it imports only the settings and the memory budget, never the engine or the
HTTP layer.
"""
