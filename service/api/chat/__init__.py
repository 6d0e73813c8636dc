"""OpenAI Chat Completions, `POST /v1/chat/completions`: the route (`routes`), the request, the
chat.completion and its chunks, typed (`protocol`), and the translation both ways with the SSE stream
encoder (`serving`), which the batch runner (service/api/batches/runner.py) calls as the route does.
May import the core of service/api and the rooms below it."""
