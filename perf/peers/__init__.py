"""Ours beside the peers (sentence-transformers behind Triton, Infinity, vLLM), one client for all, and the peers'
bundle."""
