"""The HTTP layer: Flask routes over the engine, thin — requests parsed into `GenerationRequest`s
(`protocol`, `inputs`, `answer_shapes`, `engine_requests`), events streamed out as JSON lines or SSE
(`serving`; each API's stream encoder beside its routes), errors mapped to statuses in one place
(`app`), the native endpoint's server-side chat histories (`histories`), API keys (`auth`). May
import any room; nothing outside this package imports it.
"""

from .app import create_app

__all__ = ["create_app"]
