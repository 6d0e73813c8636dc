"""OpenAI's Responses API, `/v1/responses`: the routes (`routes`), the request, the response object
and its stream's events typed (`protocol`), the translation both ways with the SSE stream encoder
(`serving`), stored responses that `previous_response_id` continues (`store`) and their copies on disk
(`files`). May import the core of service/api and the rooms below it."""
