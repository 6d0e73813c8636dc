"""Who may call, and how much: the API key of a request resolved to its tenant (`auth`); the tenants,
what each owns, its fair share and its cache namespace (`tenants`); each tenant's requests and tokens
a minute (`rates`); CORS for pages of other origins (`cors`). May import the rooms below service/api,
nothing of service/api."""
