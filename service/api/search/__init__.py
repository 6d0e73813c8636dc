"""Search: OpenAI Embeddings (`POST /v1/embeddings`), the Cohere/Jina rerank that vLLM and llama.cpp serve
(`POST /v1/rerank`, `/v2/rerank`) and vLLM's `POST /v1/score` — the routes (`routes`: JSON, and
multipart forms for curl), the requests and answers, typed (`protocol`), and their translation to the
engine's search requests and back (`serving`), which the batch runner (service/api/batches/runner.py)
calls for `/v1/embeddings` lines as the route does. May import the core of service/api and the rooms
below it."""
