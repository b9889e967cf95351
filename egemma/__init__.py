"""EmbeddingGemma engine: checkpoint loading, tokenisation and the packed varlen Gemma3 encoder."""
