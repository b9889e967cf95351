"""Fused ops of the Gemma3 encoder: torch-native references (`native`), Triton-lang kernels (`triton_ops`, the
fused gate_up GEMM `fused_gemm`, the layer stack as one kernel `layer_stack`) and the C tokenizer (`bpe`). The
engine chooses among them (egemma.engine.select, egemma.engine.tuning); nothing here imports the engine."""
