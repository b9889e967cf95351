"""The layer stack as one kernel (egemma/kernels/layer_stack.py) against the layered forward for small batches: checked
(bf16 cosine; one launch with grid barriers == one launch a phase), timed in CUDA graphs, then its own clock read
after each phase (program 0, %globaltimer) to say which phase costs what.

  python -m perf.engine.bench_small_batch CHECKPOINT [--tokens 16,32]    (gpu_run.sh small)"""
import argparse

import torch
import torch.nn.functional as F

from egemma.engine.config import ModelConfig
from egemma.engine.model import Encoder, Packed
from egemma.kernels import layer_stack
from egemma.engine.select import attention_fn, available_norm_backends, make_ops, time_ms


def graph_batch(lengths, t, vocab, dev):
    """A Packed batch as the CUDA graphs lay one out (egemma.engine.graphs): t tokens, the padding as one more
    sequence, the unused sequence slots empty (cu_seqlens repeats)."""
    g = torch.Generator().manual_seed(t)
    n = sum(lengths)
    ids = torch.cat([torch.randint(4, vocab, (n,), generator=g), torch.zeros(t - n, dtype=torch.long)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + [n] * 3 + [t], dtype=torch.int32)
    pos = torch.cat([torch.arange(k) for k in lengths] + [torch.zeros(t - n, dtype=torch.long)])
    return Packed(ids.to(dev), pos.to(dev), cu.to(dev), t), n


BATCHES = {16: [5, 9], 32: [1, 20, 7]}  # 20 tokens reach past the small checkpoint's window of 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--tokens", default="16,32")
    args = ap.parse_args()
    cfg, dev = ModelConfig.load(args.checkpoint), torch.device("cuda")
    model = Encoder(cfg, torch.bfloat16, dev)
    tokens = [int(t) for t in args.tokens.split(",")]
    ops = make_ops("sgl-kernel" if "sgl-kernel" in available_norm_backends(dev) else "triton", dev, torch.bfloat16,
                   cfg.hidden)
    fa2 = attention_fn("fa2")  # what the engine picks at these sizes
    for t in tokens:
        b, n = graph_batch(BATCHES.get(t, [t]), t, cfg.vocab_size, dev)
        layered, one = model.forward(b, ops, (fa2, fa2))[:n], model.forward_stack(b, ops)[:n]
        assert torch.equal(one, model.forward_stack(b, ops, sync=False)[:n])  # the grid barriers hold
        cos = F.cosine_similarity(one.float(), layered.float()).min().item()
        assert cos >= 0.999, cos
        ms = {"layered": time_ms(lambda: model.forward(b, ops, (fa2, fa2)), reps=11),
              "one kernel": time_ms(lambda: model.forward_stack(b, ops), reps=11)}
        print(f"{t} tokens: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()) + f" (min cosine {cos:.5f})")
        P = layer_stack.PHASES
        times = torch.zeros(P * cfg.layers + 2, dtype=torch.int64, device=dev)
        for _ in range(3):
            model.forward_stack(b, ops, times=times)
        us = (times[1:] - times[:-1]).double().cpu() / 1e3  # per phase, after its barrier
        per = [us[i:P * cfg.layers:P].median().item() for i in range(P)]
        print("  per phase, median over layers, us: " + ", ".join(f"{n} {v:.2f}" for n, v in zip("ABCDE", per))
              + f", final {us[P * cfg.layers].item():.2f}; all {us[:P * cfg.layers + 1].sum().item():.1f}")


if __name__ == "__main__":
    main()
