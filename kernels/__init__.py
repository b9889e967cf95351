"""Fused ops of the Gemma3 encoder: torch-native references (`native`), Triton-lang kernels (`triton_ops`)
and the choice among them and sgl-kernel (`select`)."""
