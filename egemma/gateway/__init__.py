"""The HTTP gateway, a process of its own in front of Triton: the fast lane for KServe v2, the OpenAI and TEI
routes, body and request checks, and the watchdog's verdict file it answers health from. Imports the engine's
torch-free config and egemma.stub's pure helpers, never egemma.ops."""
