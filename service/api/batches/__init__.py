"""OpenAI's Files and Batches APIs over the job store (service/jobs/): the routes (`routes`), uploads
and batches checked and made, and the API's state — the job store, this instance's runner (`serving`);
the runner, which runs batch lines as Chat Completions requests in a request context of their own
(`runner`); the objects and the batch body typed for /openapi.json (`protocol`). May import the core
of service/api, chat/ (a line is a Chat Completions request) and the rooms below it."""
