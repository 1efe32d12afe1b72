"""text-embeddings-inference's gRPC API (package ``tei.v1``) on its own port, in the same process and event loop as
HTTP: proto/tei.proto (the wire), build.py (its stubs, generated at install time), stubs.py (the generated modules,
or a clear error), status.py (a kind's gRPC code), call.py (what every RPC shares: key, tenant, deadline, metrics,
log, trace), the servicers (embed.py, scores.py, tokens.py) and server.py (the server, health and reflection)."""
