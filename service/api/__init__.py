"""The HTTP layer: Flask routes over the engine, one package per API — each a `routes` module (Flask: the
blueprint, thin), a `protocol` module (its pydantic request and answer schemas) and a `serving` module
(a body turned into the engine's request, the engine's events into its answer or its stream encoder; no
Flask) — and a small shared core. The APIs: OpenAI Chat Completions (`chat/`), the native curl-first
endpoint and its server-side histories (`native/`), OpenAI Responses and its stored responses
(`responses/`), OpenAI Conversations (`conversations/`), Anthropic Messages (`anthropic/`), embeddings,
rerank and score (`search/`), OpenAI Files and Batches and the runner of batch lines (`batches/`); API
keys, tenants, their rates and CORS (`access/`); models, liveness, readiness, metrics and the browser
page (`ops/`). The core: the app factory, which builds each API's state and each request's context
(`app`); the state the routes share
(`state`); the request context every translation takes (`context`); the Flask side of the routes — body,
headers, streamed and error responses (`http_io`); streaming a generation's events, or collecting them,
and their wire framing (`streaming`); client input decoded into the engine's messages (`inputs`); the
engine's request built, its token limit checked (`engine_requests`); the answer's grammar and tools
(`answer_shapes`); each API's error body (`error_shapes`); the OpenAPI document (`openapi`); the schema
parts several APIs share (`schemas`). An API's package may import the core, access/ and the rooms below
service/api (batches/ also chat/ and search/; conversations/ also responses/, whose input items it
keeps, and responses/ also conversations/, which it continues); of the core, `app`, `state`, `context`
and `openapi` import the packages they wire together; no module but `app` imports a route module; the
`serving` and `protocol` modules import no Flask, neither themselves nor through what they import.
Nothing outside this package imports it.
"""

from .app import create_app
from .state import app_state

__all__ = ["app_state", "create_app"]
