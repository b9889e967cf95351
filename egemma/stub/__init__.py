"""What runs inside Triton's Python-backend stubs: per-request options, the two model adapters' shared helpers
(egemma.stub.adapter), metrics and the instances' heartbeats. Imports the engine, never egemma.gateway or egemma.ops."""
