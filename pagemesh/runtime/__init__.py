"""The runtime every service shares: configuration and flags, the registry and its entries,
the gRPC server's bootstrap, TLS and internal auth, telemetry and metrics, request
checkpoints, the tokenizer, images and media, ports. It imports no service, no client API
and no tool: every arrow into it points down."""
