"""Anthropic's Messages API, `/v1/messages` and `/v1/messages/count_tokens`: the routes (`routes`), the
request, the message and its stream's events typed (`protocol`), the translation both ways with the SSE
stream encoder (`serving`). May import the core of service/api and the rooms below it."""
