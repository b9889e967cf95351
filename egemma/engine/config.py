"""The engine's two configs, torch-free (the gateway reads them): ModelConfig, one per loaded checkpoint (Gemma3
shapes from config.json plus the sentence-transformers modules: pooling, Dense projector, Normalize, prompts,
max_seq_length, from the files around it), and EngineConfig, how the engine serves it, which holds every engine
setting's one default (the encoder's config.pbtxt leaves them empty)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


# A file in every checkpoint scripts/make_checkpoint.py generates (random weights): the server says it serves a demo
# in its log and in its answers (/info, /v1/models).
DEMO_MARKER = "egemma-demo.json"


class CheckpointError(ValueError):
    """The checkpoint directory is unusable; the message names the file or weight at fault."""


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class DenseSpec:
    path: Path  # directory holding config.json and model.safetensors
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    attn_scale: float
    window: int  # attend where |i - j| <= window on sliding layers (two-sided)
    sliding: tuple[bool, ...]  # per layer
    rope_base_local: float
    rope_base_global: float
    max_positions: int
    max_seq_length: int  # tokenizer truncation (sentence-transformers' max_seq_length)
    bos_id: int
    eos_id: int
    pad_id: int
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    demo: bool = False  # a generated checkpoint with random weights (DEMO_MARKER)

    @property
    def out_dim(self) -> int:
        return self.dense[-1].out_features if self.dense else self.hidden

    def shape(self) -> dict:
        """What the kernels' timing depends on (egemma.engine.tuning's key)."""
        return dict(vocab=self.vocab_size, hidden=self.hidden, layers=self.layers, heads=self.heads,
                    kv_heads=self.kv_heads, head_dim=self.head_dim, intermediate=self.intermediate, window=self.window,
                    sliding=list(self.sliding), out_dim=self.out_dim, positions=self.max_positions)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path).expanduser().resolve()
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        c = _read_json(path / "config.json")
        if c.get("model_type") not in ("gemma3_text", "gemma3"):
            raise CheckpointError(f"{path}/config.json: model_type {c.get('model_type')!r} is not gemma3_text")
        if not c.get("use_bidirectional_attention", False):
            raise CheckpointError(f"{path}/config.json: use_bidirectional_attention is not true; "
                                  "this engine serves the bidirectional (embedding) Gemma3 only")
        if c.get("rope_scaling") or c.get("attn_logit_softcapping"):
            raise CheckpointError(f"{path}/config.json: rope_scaling / attn_logit_softcapping are not supported")
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or [
            "full_attention" if (i + 1) % c.get("_sliding_window_pattern", c.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention" for i in range(n)]
        rope = c.get("rope_parameters") or {}
        base_global = rope.get("full_attention", {}).get("rope_theta", c.get("rope_theta", 1_000_000.0))
        base_local = rope.get("sliding_attention", {}).get("rope_theta", c.get("rope_local_base_freq", 10_000.0))
        # transformers turns the config's window into `sliding_window // 2 + 1` and masks |i-j| < that.
        window = c["sliding_window"] // 2
        st = _sentence_transformers_modules(path)
        max_pos = c.get("max_position_embeddings", 2048)
        return cls(
            path=path, vocab_size=c["vocab_size"], hidden=c["hidden_size"], layers=n,
            heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
            intermediate=c["intermediate_size"], eps=c.get("rms_norm_eps", 1e-6),
            attn_scale=c.get("query_pre_attn_scalar", c["head_dim"]) ** -0.5, window=window,
            sliding=tuple(t == "sliding_attention" for t in types),
            rope_base_local=float(base_local), rope_base_global=float(base_global),
            max_positions=max_pos, max_seq_length=min(st.pop("max_seq_length", max_pos), max_pos),
            bos_id=c.get("bos_token_id", 2), eos_id=c.get("eos_token_id", 1), pad_id=c.get("pad_token_id", 0),
            demo=(path / DEMO_MARKER).is_file(), **st)


def _sentence_transformers_modules(path: Path) -> dict:
    """Pooling / Dense / Normalize / prompts as sentence-transformers would build them. A bare Gemma3
    checkpoint (no modules.json) gets what sentence-transformers gives it: mean pooling, nothing else."""
    out: dict = {}
    if (path / "sentence_bert_config.json").exists():
        out["max_seq_length"] = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
        if out["max_seq_length"] is None:
            del out["max_seq_length"]
    if (path / "config_sentence_transformers.json").exists():
        stc = _read_json(path / "config_sentence_transformers.json")
        out["prompts"] = dict(stc.get("prompts") or {})
        out["default_prompt_name"] = stc.get("default_prompt_name")
    if not (path / "modules.json").exists():
        return out
    dense, normalize = [], False
    for m in _read_json(path / "modules.json"):
        kind = m["type"].rsplit(".", 1)[-1]
        mdir = path / m.get("path", "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            p = _read_json(mdir / "config.json")
            modes = [k for k, v in p.items() if k.startswith("pooling_mode") and v]
            if modes != ["pooling_mode_mean_tokens"] or not p.get("include_prompt", True):
                raise CheckpointError(f"{mdir}: only mean pooling over all tokens is supported, got {p}")
        elif kind == "Dense":
            d = _read_json(mdir / "config.json")
            act = d.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers' default
            if not act.endswith("Identity"):
                raise CheckpointError(f"{mdir}: Dense activation {act} is not supported (Identity only)")
            dense.append(DenseSpec(mdir, d["in_features"], d["out_features"], bool(d.get("bias", True))))
        elif kind == "Normalize":
            normalize = True
        else:
            raise CheckpointError(f"{path}/modules.json: module type {m['type']} is not supported")
    out["dense"] = tuple(dense)
    out["normalize"] = normalize
    return out


@dataclass(frozen=True)
class EngineConfig:
    """How the engine serves a checkpoint. The encoder's config.pbtxt parameters of the same names set it (empty:
    the default here, the only copy)."""
    checkpoint: str
    device: str = "auto"  # "auto": the current CUDA device (cuda:N) when present, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu. fp16 overflows in Gemma3: refused.
    norm_backend: str = "auto"  # auto (fastest per op, timed at load) | sgl-kernel | triton | native
    attention_backend: str = "auto"  # auto (timed per bucket) | fa3 | fa2 | native
    cuda_graphs: bool = True
    max_tokens: int = 16384  # tokens per forward; the largest graph bucket. Larger batches are split.
    max_seqs: int = 256  # sequences per forward
    # one kernel choice per op for every batch: a sequence's embedding has the same bits whatever it is batched with
    # (egemma.engine.tuning). Off by default: one query costs 26% more engine time on the H200 (no layer stack;
    # perf/RESULTS.md, "Determinism")
    deterministic: bool = False

    @classmethod
    def from_params(cls, checkpoint: str, params: dict[str, str]) -> "EngineConfig":
        """From config.pbtxt string parameters; unknown keys are an error."""
        fields = {f: cls.__dataclass_fields__[f].type for f in cls.__dataclass_fields__ if f != "checkpoint"}
        unknown = set(params) - set(fields)
        if unknown:
            raise ValueError(f"unknown encoder parameters {sorted(unknown)}; known: {sorted(fields)}")
        kw = {}
        for k, v in params.items():
            kw[k] = v.lower() in ("1", "true", "yes") if fields[k] == "bool" else int(v) if fields[k] == "int" else v
        return cls(checkpoint=checkpoint, **kw)
