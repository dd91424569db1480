"""The API's route modules, one per resource (`api.app` includes their routers): `harvest`
(bulk jobs), `files` (signed downloads), `completions` and `chat` (inline activations),
`models`. A route reads, checks and answers; what it needs comes in as `api.deps` dependencies."""
