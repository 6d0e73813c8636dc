"""What serves every API and none: models (`/v1/models`), liveness, readiness, Prometheus metrics and
the OpenAPI document (`routes`), the model card and list typed (`protocol`), the browser page and its
static files (`web`). May import the core of service/api and the rooms below it."""
