"""The HTTP layer: Flask routes over the engine, thin — requests parsed into `GenerationRequest`s
(`protocol`, `inputs`, `answer_shapes`, `engine_requests`), events streamed out as JSON lines or SSE
(`serving`; each API's stream encoder beside its routes), errors mapped to statuses in one place
(`app`) and shaped per API (`error_shapes`), the native endpoint's server-side chat histories
(`histories`), API keys (`auth`), CORS (`cors`). Each further API is a route module, its protocol
and its translation onto the one engine path: Anthropic Messages (`anthropic_*`), OpenAI Responses
(`openai_responses_*`, its stored responses in `stored_responses`). May import any room; nothing
outside this package imports it.
"""

from .app import create_app

__all__ = ["create_app"]
