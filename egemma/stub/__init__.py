"""What runs inside Triton's Python-backend stubs: output shaping by the request options (their parser:
egemma.spec), the two model adapters' shared helpers (egemma.stub.adapter), metrics and the instances' heartbeats.
Imports the engine, never egemma.gateway or egemma.ops."""
