"""The client API: `SamplingParams` and `BeamSearchParams` (vLLM's names), the request
options and their validation (options/), and the gRPC SDK (`Client`, `AsyncClient`, sdk/).
It imports the runtime's TLS and keepalive settings and the protos, never a service.
`import pagemesh` hands these names on (pagemesh/__init__.py)."""
