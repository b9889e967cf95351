"""What the tests share: generated texts, the sentence-transformers references every answer is compared with, one
tolerance, request builders for both clients, a concurrent request driver, clean-error and statistics checks,
waiting on a condition, and a launcher process that takes its tritonservers with it."""
import os
import queue
import random
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.ops import shm
from egemma.ops.procfs import argv, children, kill_group
from egemma.spec import MAX_TEXT_BYTES

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5  # fp32 on CPU: every served embedding equals sentence-transformers' to this, element by element
WORDS = ("the a of to and in is it for on with as was at by search result query text title none task "
         "kalo mine rusa tivo zequ than erin onst kami lovo").split()
UNICODE = ["Grüße aus Köln", "naïve café", "日本語のテキスト", "emoji 🚀🔥", "Ωmega ∑ ∫", "tab\tand\nnewline"]
INVALID = "StatusCode.INVALID_ARGUMENT"


def make_texts(n: int, max_words: int, seed: int = 0) -> list[str]:
    """n texts from 0 to max_words words (~1-2 tokens each), with unicode and literal special tokens mixed in."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(int(max_words * i / max(n - 1, 1)))]
        if i % 5 == 1:
            words.insert(rng.randint(0, len(words)), rng.choice(UNICODE))
        if i % 7 == 3:
            words.insert(rng.randint(0, len(words)), rng.choice(["<eos>", "<bos>", "<pad>", "<unk>"]))
        out.append(" ".join(words))
    return out


GOOD = make_texts(12, 80, seed=11)  # sent beside bad requests, and the still-serving check (conftest.good_ref)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_close(got, ref, tol=TOL):
    """The one check of a served embedding against its reference: shape, fp32, finite, cosine >= 1 - tol and no
    element off by more than tol."""
    assert got.shape == ref.shape and got.dtype == np.float32, (got.shape, ref.shape, got.dtype)
    assert np.isfinite(got).all()
    assert cosine(got, ref).min() >= 1 - tol and np.abs(got - ref).max() <= tol


_st_cache: dict = {}


def st_model(path: Path):
    from sentence_transformers import SentenceTransformer
    if path not in _st_cache:
        _st_cache[path] = SentenceTransformer(str(path), device="cpu")
    return _st_cache[path]


def st_ids(model, texts: list[str], **kw) -> list[list[int]]:
    """Token ids exactly as sentence-transformers builds them (prompt kwargs as for encode)."""
    prompt = kw.get("prompt")
    if kw.get("prompt_name"):
        prompt = model.prompts[kw["prompt_name"]]
    f = model.tokenize([(prompt or "") + t for t in texts])
    return [r[:int(m.sum())].tolist() for r, m in zip(f["input_ids"], f["attention_mask"])]


def st_embed_ids(model, seqs: list[list[int]]) -> np.ndarray:
    """sentence-transformers' modules (Transformer, Pooling, Dense, Normalize) on given id sequences."""
    out = []
    for s in seqs:  # one at a time: no padding, nothing to differ by
        feats = {"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s), dtype=torch.long),
                 "modality": "text"}
        with torch.inference_mode():
            out.append(model(feats)["sentence_embedding"][0].float().numpy())
    return np.stack(out)


def eos_added(model) -> bool:
    return model.tokenizer("a")["input_ids"][-1] == model.tokenizer.eos_token_id


def expected_ids(model, texts: list[str], **kw) -> list[list[int]]:
    """sentence-transformers' ids, with EOS appended (truncating to keep it last) where its tokenizer omits it."""
    ids = st_ids(model, texts, **kw)
    if eos_added(model):
        return ids
    return [s[:model.max_seq_length - 1] + [model.tokenizer.eos_token_id] for s in ids]


def reference(path: Path, texts: list[str], **kw) -> np.ndarray:
    """What a served embedding must equal: SentenceTransformer.encode; for a checkpoint whose tokenizer omits
    EOS, the same modules on `expected_ids`."""
    m = st_model(path)
    if eos_added(m):
        return m.encode(texts, convert_to_numpy=True, **kw)
    return st_embed_ids(m, expected_ids(m, texts, **kw))


def text_input(texts, mod=grpcclient):
    """TEXT [n, 1] from str (UTF-8 encoded) or raw bytes (sent as they are)."""
    i = mod.InferInput("TEXT", [len(texts), 1], "BYTES")
    i.set_data_from_numpy(np.array([[t if isinstance(t, bytes) else t.encode()] for t in texts],
                                   dtype=object).reshape(len(texts), 1))
    return i


def raw_input(name, datatype, arr):
    """An input of any name, datatype and shape, as a client could send it."""
    i = grpcclient.InferInput(name, list(arr.shape), datatype)
    i.set_data_from_numpy(arr)
    return i


def ids_input(rows, seq_len=None, pad=0):
    L = max(len(r) for r in rows)
    ids = np.full((len(rows), L), pad, dtype=np.int32)
    for j, r in enumerate(rows):
        ids[j, :len(r)] = r
    i = grpcclient.InferInput("INPUT_IDS", list(ids.shape), "INT32")
    i.set_data_from_numpy(ids)
    inputs = [i]
    if seq_len is not False:
        s = grpcclient.InferInput("SEQ_LEN", [len(rows), 1], "INT32")
        s.set_data_from_numpy(np.array([[len(r)] for r in rows], dtype=np.int32))
        inputs.append(s)
    return inputs


def fire_concurrently(c, jobs, parameters=None, timeout=120):
    """jobs: [(model, inputs)]; all sent at once with async_infer (with per-job request parameters if given);
    returns [(result, error)] in job order."""
    done = queue.Queue()
    for k, (model, inputs) in enumerate(jobs):
        c.async_infer(model, inputs, callback=lambda result, error, k=k: done.put((k, result, error)),
                      parameters=parameters[k] if parameters else None, client_timeout=timeout)
    out = [None] * len(jobs)
    for _ in jobs:
        k, r, e = done.get(timeout=timeout + 10)
        out[k] = (r, e)
    return out


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling interval; the condition itself is what is waited on


def assert_clean_error(e, *fragments, status=INVALID):
    """A per-request error the client can act on: the expected status and a message naming the problem."""
    assert isinstance(e, InferenceServerException), f"expected an error, got {e!r}"
    assert e.status() == status, (e.status(), e.message())
    for f in fragments:
        assert f in e.message(), e.message()


def model_stats(c, model) -> tuple[int, int]:
    """(inference_count, execution_count) of a model from Triton's statistics API: requests (batch rows) it
    ran, and the executes they ran in."""
    s = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0))


def max_text_bytes(server) -> int:
    """The tokenizer model's max_text_bytes as the server's rendered repository sets it (empty: the default)."""
    cfg = (server.repo / "embeddinggemma_tokenizer" / "config.pbtxt").read_text()
    return int(re.search(r'key: "max_text_bytes" value: \{ string_value: "(\d*)"', cfg).group(1) or MAX_TEXT_BYTES)


def shm_prefix(server_pid: int) -> str | None:
    """The shared-memory prefix a running tritonserver was started with (egemma.ops.shm)."""
    return next((a.split("shm-region-prefix-name=", 1)[1] for a in argv(server_pid) if "shm-region-prefix-name=" in a),
                None)


class Launcher:
    """A launcher process (argv: `python -m egemma.ops.launcher ...`) with its stdout and stderr in files under d;
    remembers every tritonserver it was seen to run, so that close() ends those too (they run in their own
    sessions: the launcher's death does not end them) and removes their shared memory."""

    def __init__(self, argv, d: Path, cwd: Path = ROOT):
        d.mkdir(parents=True)
        self.stdout, self.stderr = d / "stdout", d / "stderr"
        self._files = [open(self.stdout, "w"), open(self.stderr, "w")]
        self.proc = subprocess.Popen([str(a) for a in argv], cwd=cwd, stdout=self._files[0], stderr=self._files[1])
        self.servers: list[int] = []

    def wait_ready(self, timeout=300.0):
        """Until the launcher printed its ready banner; it must not have exited meanwhile (its stderr says why)."""
        wait_for(lambda: "ready:" in self.stdout.read_text() or self.proc.poll() is not None, timeout,
                 "the launcher to print ready")
        assert self.proc.poll() is None, self.stderr.read_text()[-3000:]

    def server_pid(self, timeout=10.0) -> int:
        """The tritonserver the launcher runs now."""
        found = []

        def find():
            found[:] = [p for p, a in children(self.proc.pid).items() if os.path.basename(a[0]) == "tritonserver"]
            return found
        wait_for(find, timeout, "a tritonserver under the launcher")
        if found[0] not in self.servers:
            self.servers.append(found[0])
        return found[0]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.servers:  # and their shared memory, as the launcher's next start would
            prefix = shm_prefix(p)
            if not kill_group(p, 30) and prefix:
                shm.remove(prefix)
        for f in self._files:
            f.close()


def assert_good_beside_bad(gateway, threads, errors: list, got: dict, ref):
    """The good requests sent in threads beside bad ones all answered with the reference, and the gateway serves."""
    import requests
    for t in threads:
        t.join(120)
    assert not errors and len(got) == len(threads), (errors, len(got))
    for v in got.values():
        assert_close(v, ref)
    assert gateway.proc.poll() is None and requests.get(f"{gateway.url}/health", timeout=10).status_code == 200
