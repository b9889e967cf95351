"""The request protocols: per-request options, the Triton adapters' shared helpers, metrics, and the HTTP
gateway. Imports the engine, never egemma.ops."""
