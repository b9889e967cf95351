"""Clients of the served model that run outside the server: `egemma-embed` (embed.py), which streams a corpus file
through the server's gRPC port into Parquet or .npy. Torch-free: only tritonclient, pyarrow and tqdm."""
