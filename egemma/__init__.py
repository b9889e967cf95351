"""google/embeddinggemma-300m on Triton, in three tiers: `engine` (checkpoint -> embeddings; no Triton, no
server), `serving` (the request protocols: options, the Triton adapters' helpers, metrics, the HTTP gateway) and
`ops` (launcher, model repository rendering, watchdog, /proc). engine imports neither of the others; serving does
not import ops. `kernels` (the fused ops, the C tokenizer) imports
none of them: the engine chooses among its kernels and times them."""
