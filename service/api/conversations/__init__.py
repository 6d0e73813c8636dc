"""OpenAI's Conversations API, `/v1/conversations`: a conversation and its items (`routes`), their
requests and objects typed (`protocol`), the items turned into the engine's messages and back, and a
response's turn added (`serving`), and the conversations kept per tenant — in the shared store where
there is one (`store`). `/v1/responses` continues one (`conversation`). May import the core of
service/api, responses/ (its input items are the same) and the rooms below it."""
