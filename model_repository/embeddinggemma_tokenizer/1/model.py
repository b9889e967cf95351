"""Triton adapter: TEXT -> INPUT_IDS / SEQ_LEN with egemma.engine.tokenizer. All texts of all requests in the
dynamic batch go through one batched tokenizer call; a bad request gets its own error, the others their ids.
Request parameters: prompt_name / prompt (prepended, as SentenceTransformer.encode), long_text (truncate, error, or
chunk: a row of the text's windows, egemma.engine.windows; with return_chunks also CHUNK_SPAN); every option is
parsed here, so malformed ones fail before tokenising, and those that shape the encoder's output leave as OPTIONS
(egemma.stub.options.to_tensor), which the response cache keys on."""
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.engine import process
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import DEFAULT_BACKEND, TextTokenizer
from egemma.engine.windows import cut
from egemma.stub import budget
from egemma.stub.instance import Heartbeat
from egemma.stub.metrics import STUB_FAMILIES, instance_stats
from egemma.spec import (CHUNK_SPAN, INPUT_IDS, MAX_TEXT_BYTES, OPTIONS, SEQ_LEN, TEXT, OptionError, RequestOptions,
                         to_tensor)
from egemma.stub.options import allowed_dimensions, check_dimensions
from egemma.stub.adapter import Adapter, setup_logging, triton_params


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        process.begin(args["model_instance_name"])
        checkpoint, params = triton_params(args["model_config"])
        self.cfg = ModelConfig.load(checkpoint)
        self.tok = TextTokenizer(self.cfg, params.get("tokenizer_json"),
                                 params.get("tokenizer_backend", DEFAULT_BACKEND))
        process.phase("tokenizer", source=self.tok.source)
        self.max_text_bytes = int(params.get("max_text_bytes", MAX_TEXT_BYTES))
        self.max_request_tokens = budget.limit(params.get(budget.PARAMETER, ""))
        # checked here too, not only in the encoder: a request the ensemble refuses never reaches the encoder, whose
        # response cache would keep an error as an empty answer (Triton 2.51; tests/test_response_cache.py)
        self.dims = allowed_dimensions(params.get("matryoshka_dims", ""), self.cfg.out_dim)
        self.a = Adapter(pb_utils)
        self.beat = Heartbeat(args["model_instance_name"])
        self.stats = instance_stats(args["model_instance_name"], STUB_FAMILIES)  # histograms, read by the gateway
        process.phase("ready")

    def _texts(self, req) -> tuple[list[str], RequestOptions, str]:
        opts = RequestOptions.parse(req.parameters())
        check_dimensions(opts, self.dims)
        prefix = self.tok.prefix(opts.prompt_name, opts.prompt)
        # prompt + text is what gets tokenised: together under max_text_bytes (a 20 MB prompt cost seconds of CPU)
        try:
            n_prefix = len(prefix.encode())
        except UnicodeEncodeError as e:
            raise OptionError(f"the prompt is not valid Unicode: {e}") from None
        if n_prefix > self.max_text_bytes:
            raise OptionError(f"the prompt has {n_prefix} bytes, over this server's max_text_bytes "
                              f"({self.max_text_bytes}, prompt and text together)")
        out = []
        for j, t in enumerate(pb_utils.get_input_tensor_by_name(req, TEXT).as_numpy().reshape(-1)):
            raw = t if isinstance(t, bytes) else str(t).encode()
            if len(raw) + n_prefix > self.max_text_bytes:
                with_prompt = f" + a {n_prefix}-byte prompt" if n_prefix else ""
                raise OptionError(f"text {j} has {len(raw)} bytes{with_prompt}, over this server's max_text_bytes "
                                  f"({self.max_text_bytes})")
            try:
                out.append(prefix + raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise OptionError(f"text {j} is not valid UTF-8: {e}") from None
        return out, opts, prefix

    def _tokenize(self, texts: list[str], chunks: int) -> list:
        """Per text: its ids, cut to max_seq_length (chunks 0), whole (1), or whole with their offsets (2)."""
        return self.tok.encode_offsets(texts) if chunks == 2 else self.tok.encode(texts, whole=chunks == 1)

    def _encode(self, parsed, responses) -> list:
        """Ids per parsed request: one call for all texts of the requests that tokenise alike (RequestOptions.chunks);
        if the tokenizer raises, request by request, so that only the requests it fails on get the error."""
        out = [None] * len(parsed)
        for kind in {opts.chunks for _, (_, opts, _) in parsed}:
            at = [k for k, (_, (_, opts, _)) in enumerate(parsed) if opts.chunks == kind]
            try:
                ids = self._tokenize([t for k in at for t in parsed[k][1][0]], kind)
            except Exception:
                ids = None
            n = 0
            for k in at:
                i, (texts, _, _) = parsed[k]
                if ids is not None:
                    out[k] = ids[n:n + len(texts)]
                    n += len(texts)
                    continue
                try:
                    out[k] = self._tokenize(texts, kind)
                except Exception as e:
                    responses[i] = self.a.internal(e, "tokenizer failure")
        return out

    def _windows(self, rows: list, opts: RequestOptions, prefix: str) -> tuple[list[np.ndarray], np.ndarray | None]:
        """(each text's windows as one row, egemma.engine.windows.cut; with return_chunks CHUNK_SPAN [chunks, 4]:
        each window's text tokens [start, end) and characters [start, end) in its text). The prompt's tokens are
        the leading ids its own tokenisation shares with the text's (a token across the prompt's end is text's)."""
        prompt = self.tok.encode([prefix], whole=True)[0][1:-1] if prefix else np.zeros(0, np.int32)
        out, spans = [], []
        for r in rows:
            seq, offs = r if opts.return_chunks else (r, None)
            m = min(len(prompt), len(seq) - 2)
            p = int(np.argmin(np.append(prompt[:m] == seq[1:1 + m], False)))  # the shared leading ids
            row, sp = cut(seq, p, self.tok.max_length, opts.chunk_overlap)
            out.append(row)
            if offs is not None:
                chars = [(offs[p + a, 0], offs[p + b - 1, 1]) if b > a else (len(prefix),) * 2 for a, b in sp]
                spans += [(a, b, max(c - len(prefix), 0), max(d - len(prefix), 0)) for (a, b), (c, d) in zip(sp, chars)]
        return out, np.array(spans, np.int32).reshape(-1, 4) if opts.return_chunks else None

    def _response(self, texts: list[str], rows: list, opts: RequestOptions, prefix: str):
        spans = None
        if opts.long_text == "chunk":
            rows, spans = self._windows(rows, opts, prefix)
        # the request's tokens as embedded, every window of it: what the per-request token budget bounds
        lens = np.array([len(r) for r in rows], dtype=np.int32)
        budget.check(int(lens.sum()), self.max_request_tokens)
        if not opts.truncate:  # only texts that reached the limit can have been cut
            for j in np.flatnonzero(lens == self.tok.max_length):
                if (n := self.tok.untruncated_length(texts[j])) > self.tok.max_length:
                    return self.a.invalid(f"text {j} has {n} tokens, over the {self.tok.max_length}-token limit "
                                          "(long_text=error, or truncate=false)")
        if len(rows) == 1:  # the common single-text request: no padding to do
            ids = rows[0][None]
        else:
            ids = np.full((len(rows), int(lens.max(initial=1))), self.cfg.pad_id, dtype=np.int32)
            for j, r in enumerate(rows):
                ids[j, :len(r)] = r
        out = {INPUT_IDS: ids, SEQ_LEN: lens[:, None], OPTIONS: to_tensor(opts, len(rows))}
        return self.a.outputs(out if spans is None else {**out, CHUNK_SPAN: spans})

    def execute(self, requests):
        with self.beat:  # start/end stamps: the watchdog sees a hung or spinning instance (egemma.stub.instance)
            return self._execute(requests)

    def _execute(self, requests):
        t0 = time.perf_counter()
        responses, parsed = self.a.parse_each(requests, self._texts)
        encoded = [(i, (texts, rows, opts, prefix)) for (i, (texts, opts, prefix)), rows
                   in zip(parsed, self._encode(parsed, responses)) if rows is not None]
        self.a.respond_each(responses, encoded, self._response)
        self.stats.observe("egemma_tokenize_duration_seconds", time.perf_counter() - t0)
        return responses
