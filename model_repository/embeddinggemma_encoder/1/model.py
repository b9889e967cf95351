"""Triton adapter: INPUT_IDS [n, L] (+ SEQ_LEN [n, 1]) -> EMBEDDING [n, D] with egemma.engine.Engine.
Every row of every request in the dynamic batch is packed into one varlen token batch; a malformed request
gets its own error and never fails the others. Request parameters, or the OPTIONS input over them: dimensions
(Matryoshka truncation + renormalisation), encoding (float -> EMBEDDING, ubinary -> EMBEDDING_UBINARY, binary ->
EMBEDDING_BINARY), and the long-text mode (OPTIONS' third column): a row over max_seq_length is then the windows of one
text (egemma.engine.windows), embedded as sequences of the same varlen batch and combined into its one vector; with
return_chunks each window's vector too (CHUNK_EMBEDDING, CHUNK_OF: the row it belongs to)."""
import json
import logging
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.engine import Engine, EngineConfig, process
from egemma.engine.windows import combine, split
from egemma.stub import budget
from egemma.stub.instance import Heartbeat, instance_device
from egemma.stub.metrics import STUB_FAMILIES, instance_stats
from egemma.spec import (CHUNK_EMBEDDING, CHUNK_OF, INPUT_IDS, OPTIONS, SEQ_LEN, OptionError, RequestOptions,
                         from_tensor)
from egemma.stub.options import allowed_dimensions, check_dimensions, shape_output
from egemma.stub.adapter import Adapter, boot_phases, setup_logging, triton_params


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        process.begin(args["model_instance_name"])
        checkpoint, params = triton_params(args["model_config"])
        dims_spec = params.pop("matryoshka_dims", "")
        self.max_request_tokens = budget.limit(params.pop(budget.PARAMETER, ""))
        params["device"] = instance_device(args, params.get("device", EngineConfig.device))
        self.engine = Engine(EngineConfig.from_params(checkpoint, params))
        boot_phases(self.engine)
        logging.getLogger("egemma").info("egemma: encoder instance %s on %s", args["model_instance_name"],
                                         self.engine.device)
        self.beat = Heartbeat(args["model_instance_name"])
        self.dims = allowed_dimensions(dims_spec, self.engine.cfg.out_dim)
        cfg = self.engine.cfg
        self.max_len, self.bos, self.eos = cfg.max_seq_length, cfg.bos_id, cfg.eos_id
        # Triton's response cache keys on the inputs only: with it on, an answer made without OPTIONS could be given
        # to a request whose parameters ask for other dimensions, so none is made (Triton does not enforce a
        # required input: checked here)
        self.needs_options = json.loads(args["model_config"]).get("response_cache", {}).get("enable", False)
        self.a = Adapter(pb_utils)
        self.seen = dict(self.engine.stats)
        self.stats = instance_stats(args["model_instance_name"], STUB_FAMILIES)  # histograms, read by the gateway
        process.phase("ready")

    def _parse(self, req) -> tuple[RequestOptions, list[np.ndarray], list[int] | None]:
        """(options, the sequences to embed, the count of each row's sequences where a row is several windows)."""
        # per request, in Python ints and one pass over the inputs: numpy reductions and pb_utils's
        # get_input_tensor_by_name (which lists every input on each call) cost more (perf/RESULTS.md, runs
        # 106-110: the CPU A/B of 56014ee)
        opts = RequestOptions.parse(req.parameters())
        t = {x.name(): x for x in req.inputs()}
        if OPTIONS in t:
            opts = from_tensor(opts, t[OPTIONS].as_numpy())
        elif self.needs_options:
            raise OptionError("this server caches responses (keyed on the inputs, never the parameters): send the "
                              "OPTIONS input, INT32 [rows, 2 or 3] of (dimensions or 0, encoding 0 float / 1 "
                              "ubinary / 2 binary[, chunks 0 / 1 long_text=chunk / 2 with return_chunks])")
        check_dimensions(opts, self.dims)
        ids = t[INPUT_IDS].as_numpy()
        if ids.ndim != 2:
            raise OptionError(f"INPUT_IDS must be [batch, tokens], got shape {list(ids.shape)}")
        rows, width = ids.shape
        lens = t[SEQ_LEN].as_numpy().reshape(-1).tolist() if SEQ_LEN in t else [width] * rows
        if len(lens) != rows:
            raise OptionError(f"SEQ_LEN has {len(lens)} rows, INPUT_IDS {rows}")
        if lens and not (1 <= min(lens) and max(lens) <= width):
            raise OptionError(f"SEQ_LEN values must lie in [1, {width}], got {lens}")
        # sum(lens): the request's tokens as embedded, every window of its texts included, on every path (the
        # ensemble, the gateway's token ids, a direct call)
        budget.check(sum(lens), self.max_request_tokens)
        rows = [ids[j, :n] for j, n in enumerate(lens)]
        if not opts.chunks or max(lens, default=0) <= self.max_len:
            return opts, rows, None
        seqs, counts = [], []
        for j, r in enumerate(rows):
            ws = split(r, self.max_len)
            if len(ws) > 1 and any(w[0] != self.bos or w[-1] != self.eos for w in ws):
                raise OptionError(f"row {j} ({len(r)} tokens, long_text=chunk) is not windows of {self.max_len} "
                                  "tokens, each BOS ... EOS (egemma.engine.windows.cut makes them)")
            seqs += ws
            counts.append(len(ws))
        return opts, seqs, counts

    def _id_errors(self, parsed) -> dict[int, str]:
        """{request index: why} for requests whose ids the engine refuses (egemma.engine.ids: the vocabulary, the
        positions; padding past SEQ_LEN is never embedded, so never checked). One check over the whole batch; only a
        batch that fails it is checked request by request."""
        seqs = [r for _, (_, rows, _) in parsed for r in rows]
        if not seqs or self.engine.check(np.concatenate(seqs), max(map(len, seqs))) is None:
            return {}
        return {i: why for i, (_, rows, _) in parsed
                if rows and (why := self.engine.check(np.concatenate(rows), max(len(r) for r in rows)))}

    def _respond(self, x, emb, a: int, b: int, opts: RequestOptions, counts: list[int] | None, seqs):
        """One request's response from the batch's vectors x and embeddings emb (its sequences: a to b)."""
        if counts is None and not opts.return_chunks:  # most requests
            return self.a.output(*shape_output(emb[a:b], opts))
        if counts is None:
            out = dict([shape_output(emb[a:b], opts)])
        else:
            out = dict([shape_output(self.engine.finish(combine(x[a:b], [len(s) for s in seqs[a:b]], counts)), opts)])
        if opts.return_chunks:
            counts = counts or [1] * (b - a)
            out[CHUNK_EMBEDDING] = shape_output(emb[a:b], opts)[1]
            out[CHUNK_OF] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)[:, None]
        return self.a.outputs(out)

    def execute(self, requests):
        with self.beat:  # start/end stamps: the watchdog sees a hung or spinning instance (egemma.stub.instance)
            return self._execute(requests)

    def _execute(self, requests):
        t0 = time.perf_counter()
        responses, parsed = self.a.parse_each(requests, self._parse)
        try:
            bad = self._id_errors(parsed)
        except Exception as e:  # unchecked ids must not reach the GPU: fail these requests, not the stub
            bad = {i: e for i, _ in parsed}
        for i, why in bad.items():
            responses[i] = self.a.invalid(why) if isinstance(why, str) else self.a.internal(why, "vocabulary check")
        spans, seqs = [], []
        for i, (opts, rows, counts) in parsed:
            if i not in bad:
                spans.append((i, len(seqs), len(seqs) + len(rows), opts, counts))
                seqs.extend(rows)
        tokens = sum(len(s) for s in seqs)
        self.beat.tokens(tokens)  # a large batch is allowed proportionally longer
        t1 = time.perf_counter()
        try:  # the windows of long texts are sequences of the same batch; one normalisation for all sequences
            x = self.engine.vectors(seqs)
            emb = self.engine.finish(x)
            t2 = time.perf_counter()
            if seqs:
                self.stats.observe("egemma_engine_duration_seconds", t2 - t1)
                self.stats.observe("egemma_batch_size", len(seqs))
                self.stats.observe("egemma_batch_tokens", tokens)
        except Exception as e:  # an engine fault fails this batch's requests cleanly, not the stub
            for i, *_ in spans:
                responses[i] = self.a.internal(e, "engine failure")
            return responses
        self.a.respond_each(responses, [(i, (x, emb, a, b, opts, counts, seqs)) for i, a, b, opts, counts in spans],
                            self._respond)
        self.stats.inc("egemma_encoder_seconds_total", n=time.perf_counter() - t0)
        for k, v in self.engine.stats.items():  # graph_replays, eager_runs
            self.stats.inc(f"egemma_{k}_total", n=v - self.seen[k])
        self.seen = dict(self.engine.stats)
        return responses
