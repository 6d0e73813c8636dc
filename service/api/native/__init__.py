"""The native curl-first endpoint, `POST /v1/chat`: the route, which reads JSON or a multipart form
(`routes`), its request and JSON lines typed (`protocol`), the translation both ways with the JSON-lines
stream encoder (`serving`), and the server-side chat histories a conversation_id continues
(`histories`). May import the core of service/api and the rooms below it."""
