"""Client for kvlens-server. Arrays come back as numpy arrays in the wire layout:
attention maps [layer][head][query][key], gradients as each Tensor's shape.

Positions, layers and heads count from 0 or, as Python indexes, from the end: a target at
position -1 reads the prompt's last token, layers=[-1] asks for the last layer, and a range
(begin, end) may take negative bounds, (-3, 0) being the last three positions (end 0: to the
end). The server resolves them and answers with the absolute indices, so results are keyed
by absolute layer and head (where a result's layer or head is -1, it is not per layer or
head, e.g. "grad.embeddings")."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Optional, Sequence

import grpc
import numpy as np

from kvlens.activation_cache import (  # noqa: F401  (get_act_name: re-exported)
    _BLOCK_OUTPUT_NORM_FAMILIES, _FULL_FINAL_NAMES, _FULL_HOOK_NAMES, ActivationCache,
    get_act_name)
from kvlens.v1 import generation_pb2 as gen
from kvlens.v1 import generation_pb2_grpc as gen_grpc
from kvlens.v1 import interpret_pb2 as ip
from kvlens.v1 import interpret_pb2_grpc as ip_grpc

_NUMPY = {ip.DTYPE_FP32: "<f4", ip.DTYPE_FP16: "<f2", ip.DTYPE_FP64: "<f8"}
_MAX_MESSAGE = 1 << 30


def decode(data: bytes, dtype: int, shape: Sequence[int] = ()) -> np.ndarray:
    """Little-endian bytes of a wire dtype → float64 array of `shape`."""
    a = np.frombuffer(data, dtype=_NUMPY.get(dtype, "<f4")).astype(np.float64)
    return a.reshape(tuple(shape)) if shape else a


def _chat(target, chat):
    """Messages [{"role": ..., "content": ...}] into a ChatPrompt field."""
    for m in chat:
        target.messages.add(role=m["role"], content=m["content"])


def _activation_cache(tensors, info) -> ActivationCache:
    """Per-hook tensors of a response (Activations' tensors, GradientProbe's hook_gradients)
    as an ActivationCache keyed "hook.layer" ("embed" without a layer)."""
    return ActivationCache(
        {(t.name if t.layer < 0 else f"{t.name}.{t.layer}"): decode(t.data, t.dtype, t.shape)
         for t in tensors}, info.num_layers, layer_norm=info.architecture == "gpt2")


def _fill_pair(msg, patch_source, targets, logit_diff):
    """A PatchSweepRequest's (or PatchSweepPair's) patch_source (text or token list) and
    objective: logit_diff=(position, a, b), else targets [(position, token)]."""
    msg.patch_source.CopyFrom(_input(text=patch_source) if isinstance(patch_source, str)
                              else _input(tokens=patch_source))
    if logit_diff is not None:
        msg.logit_diff.position, msg.logit_diff.token_a, msg.logit_diff.token_b = logit_diff
    else:
        for pos, tok in targets:
            msg.log_prob.targets.add(position=pos, token=tok)


def _input(text=None, tokens=None, session_id=None, add_bos=None, doc_ids=None, chat=None):
    """add_bos None: the model's own setting (the server's default). chat: a conversation,
    written by the model's chat template as Client.generate(chat=...) writes it."""
    p = ip.PromptInput()
    if chat is not None:
        _chat(p.chat, chat)
        if add_bos is not None:
            p.add_bos = add_bos
    elif tokens is not None:
        p.token_ids.ids.extend(int(t) for t in tokens)
    elif text is not None:
        p.text = text
        if add_bos is not None:
            p.add_bos = add_bos
    elif session_id is not None:
        p.session_id = session_id
    else:
        raise ValueError("give text, tokens, chat or session_id")
    if doc_ids is not None:
        p.doc_ids.extend(int(d) for d in doc_ids)
    return p


def _generate_request(text, tokens, chat, max_new_tokens, steering, session_id=None):
    """A GenerateRequest for one of text, tokens or chat, with its steering dicts; with
    session_id, appended to that session's conversation."""
    req = gen.GenerateRequest()
    if session_id is not None:
        req.session_id = session_id
    if chat is not None:
        _chat(req.chat, chat)
    elif tokens is not None:
        req.token_ids.ids.extend(tokens)
    else:
        req.text = text
    req.stopping.max_new_tokens = max_new_tokens
    for s in steering:
        _steering(req.steering.add(), s)
    return req


def _sampling_and_stopping(req, sampling, stop, min_new_tokens, ignore_eos):
    """SamplingParams fields from a dict (logit_bias {token: bias}), stop strings,
    min_new_tokens and ignore_eos onto a GenerateRequest."""
    for field, value in (sampling or {}).items():
        if field == "logit_bias":
            for token, bias in value.items():
                req.sampling.logit_bias[int(token)] = float(bias)
        else:
            setattr(req.sampling, field, value)  # an unknown field raises AttributeError
    req.stopping.stop.extend(stop)
    req.stopping.min_new_tokens = min_new_tokens
    req.stopping.ignore_eos = ignore_eos


def _finish_name(final) -> str:
    """A GenerateFinal's finish reason as a word: "length", "eos", "stop", ..."""
    return gen.FinishReason.Name(final.finish_reason)[len("FINISH_REASON_"):].lower()


def _steering(v, s: dict):
    """A steering dict (generate's) into the SteeringVector v."""
    v.hook = s.get("hook", "")
    v.sae = s.get("sae", "")
    v.feature = int(s.get("feature", 0))
    v.vector.extend(float(x) for x in s.get("vector", ()))
    if "coefficient" in s:
        v.coefficient = float(s["coefficient"])
    v.start_position = int(s.get("start_position", 0))


def _precision(fp64: bool):
    return ip.PRECISION_FP64 if fp64 else ip.PRECISION_FP32


@dataclasses.dataclass
class PromptScores:
    tokens: list          # the prompt's token ids
    logprobs: np.ndarray  # [len(tokens)]: log p(token i | tokens before it); NaN at 0
    top: list             # per position, [(token, logprob), ...] most likely first; [] at 0

    def total(self) -> float:
        """log p of the prompt after its first token (lm-eval's loglikelihood)."""
        return float(np.nansum(self.logprobs))


@dataclasses.dataclass
class Generation:
    tokens: list          # the generated token ids
    text: str             # their text
    logprobs: np.ndarray  # [len(tokens)]: log p(token i | prompt and tokens before it)
    top: list             # per token, [(token, logprob), ...] most likely first
    finish_reason: str    # "length", "eos", "stop", "cancelled" or "context"

    def total(self) -> float:
        """log p of the generated tokens given the prompt."""
        return float(np.sum(self.logprobs))


@dataclasses.dataclass
class StreamChunk:
    tokens: list                         # the token ids produced since the previous chunk
    text: str                            # their text (never splits a UTF-8 character)
    finish_reason: Optional[str] = None  # on the last chunk: "length", "eos", "stop", ...


@dataclasses.dataclass
class AttentionMaps:
    tokens: list
    layers: list
    heads: list
    queries: tuple        # [begin, end)
    keys: tuple
    precision: str
    probs: Optional[np.ndarray]   # [layers, heads, queries, keys]
    scores: Optional[np.ndarray]
    summaries: list               # dicts: layer, head, entropy, prev_token, sink, induction
    chunks: int = 0

    def summary_grid(self, name: str) -> np.ndarray:
        """One summary as a [layers, heads] array (in self.layers / self.heads order)."""
        grid = np.full((len(self.layers), len(self.heads)), np.nan)
        li = {l: i for i, l in enumerate(self.layers)}
        hi = {h: i for i, h in enumerate(self.heads)}
        for s in self.summaries:
            grid[li[s["layer"]], hi[s["head"]]] = s[name]
        return grid


# The sweep hooks with a cell per head (per KV head for k and v).
_HEAD_HOOKS = ("q", "k", "v", "z", "pattern")


@dataclasses.dataclass
class PatchSweep:
    """Interpret.PatchSweep's answer. metric: [layers, positions] ([layers, heads,
    positions] for q, z and pattern; [layers, KV heads, positions] for k and v; without the
    positions axis for all_positions), the objective with that one activation patched from
    the source; clean and source: the objective on each prompt's own run."""
    precision: str
    hook: str
    layers: list
    positions: tuple  # [begin, end)
    clean: float
    source: float
    metric: np.ndarray
    num_pairs: int = 1  # with more_pairs: clean, source and metric are means over the pairs
    # with per_pair: each pair's own, [num_pairs], [num_pairs] and [num_pairs, *metric.shape]
    pair_clean: Optional[np.ndarray] = None
    pair_source: Optional[np.ndarray] = None
    pair_metric: Optional[np.ndarray] = None

    def recovered(self) -> np.ndarray:
        """(metric − clean) / (source − clean): 0 where the patch changes nothing, 1 where it
        moves the objective all the way to the source's (TransformerLens's normalised patching
        metric, with this run as the corrupted one when the source is the clean prompt)."""
        return (self.metric - self.clean) / (self.source - self.clean)

    def pair_recovered(self) -> np.ndarray:
        """recovered() of each pair, [num_pairs, *metric.shape] (needs per_pair=True); their
        mean weighs every pair alike, where recovered() of the means weighs pairs by how far
        their source moves the objective."""
        if self.pair_metric is None:
            raise ValueError("pair_recovered: ask patch_sweep with per_pair=True")
        shape = (-1,) + (1,) * (self.pair_metric.ndim - 1)
        return ((self.pair_metric - self.pair_clean.reshape(shape)) /
                (self.pair_source - self.pair_clean).reshape(shape))


def _from_end(index: Optional[int], count: int) -> int:
    """An index as Python counts it (negative: from the end of `count`); None → -1, the
    wire's "not per layer / head"."""
    if index is None:
        return -1
    return index + count if index < 0 else index


@dataclasses.dataclass
class GradientProbe:
    precision: str
    objective: float
    tokens: list
    tensors: dict    # name → {(layer, head): array}; -1 where not per layer / head
    verify: Optional[dict]
    num_layers: int = 0    # the model's, for layers counted from the end
    num_heads: int = 0
    num_kv_heads: int = 0
    # with hooks=: the gradients at those hooks, keyed and laid out as run_with_cache's
    # activations (grad_cache["mlp_post", -1] * cache["mlp_post", -1]: neuron attribution)
    grad_cache: Optional["ActivationCache"] = None

    def get(self, name: str, layer: Optional[int] = None,
            head: Optional[int] = None) -> np.ndarray:
        """name's array at (layer, head), each counted from the end when negative (the
        head a KV head for grad.k, grad.rot_k and grad.v; layer -1 the last layer, as the
        requests' layers — grad.residual's stream leaving it is layer num_layers); leave out
        what the tensor is not per (grad.embeddings: get("grad.embeddings"))."""
        heads = self.num_kv_heads if name in ("grad.k", "grad.rot_k", "grad.v") else self.num_heads
        return self.tensors[name][(_from_end(layer, self.num_layers), _from_end(head, heads))]


@dataclasses.dataclass
class CachedKvProbe:
    precision: str
    objective: float  # J = log p(target | the last new token)
    num_cached: int   # P, the session's cached positions
    tensors: dict     # "grad.cached_k" / "grad.cached_v" → {layer: [P, n_kv_heads·d_head]}
    num_layers: int = 0  # the model's, for layers counted from the end

    def get(self, name: str, layer: int) -> np.ndarray:
        """name's array at `layer` (negative: from the end)."""
        return self.tensors[name][_from_end(layer, self.num_layers)]


class Client:
    def __init__(self, address: str, timeout: float = 300.0):
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE)])
        self.generation = gen_grpc.GenerationStub(self.channel)
        self.interpret = ip_grpc.InterpretStub(self.channel)
        self.timeout = timeout
        self._info = None  # the model's ModelInfo, asked for once (run_with_cache)

    # --- Generation ---
    def model_info(self):
        return self.generation.GetModelInfo(gen.GetModelInfoRequest(), timeout=self.timeout)

    def _cached_info(self):
        if self._info is None:
            self._info = self.model_info()
        return self._info

    def hook_names(self) -> list:
        """Every hook of the model under TransformerLens's full name: hook_embed (and
        GPT-2's hook_pos_embed), then layer by layer blocks.0.hook_resid_pre, …,
        blocks.0.attn.hook_pattern, …, blocks.0.ln2.hook_normalized, blocks.1…, then
        ln_final.hook_scale and ln_final.hook_normalized (hook_rot_q / hook_rot_k for rotary
        models only, as mlp.hook_pre_linear for gated FFNs, and ln1_post / ln2_post for Gemma
        2 and 3). The short name ln_final (the final norm's output, weight in) has no full
        one."""
        info = self._cached_info()
        rotary = info.architecture == "llama"
        lacks = set() if rotary else {"rot_q", "rot_k", "mlp_pre_linear"}  # (no rotation, gate)
        if info.family not in _BLOCK_OUTPUT_NORM_FAMILIES:
            lacks |= {s for s in _FULL_HOOK_NAMES.values() if "_post_" in s}
        return (["hook_embed"] + ([] if rotary else ["hook_pos_embed"]) +
                [f"blocks.{l}.{full}" for l in range(info.num_layers)
                 for full, short in _FULL_HOOK_NAMES.items() if short not in lacks] +
                list(_FULL_FINAL_NAMES))

    def tokenize(self, text: Optional[str] = None, add_bos: Optional[bool] = None,
                 chat=None) -> list:
        """add_bos None: the model's own setting. chat: a conversation instead of text, as
        generate(chat=...) writes it."""
        request = gen.TokenizeRequest()
        if chat is not None:
            _chat(request.chat, chat)
        else:
            request.text = text
        if add_bos is not None:
            request.add_bos = add_bos
        r = self.generation.Tokenize(request, timeout=self.timeout)
        return list(r.token_ids)

    def to_single_token(self, text: str) -> int:
        """The id of the one token the server's tokenizer makes of `text` (no BOS), as
        TransformerLens's to_single_token; ValueError naming the ids when it makes more or
        fewer."""
        ids = self.tokenize(text, add_bos=False)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens {ids}, not one")
        return ids[0]

    def pieces(self, tokens: Iterable[int]) -> list:
        return [self.generation.Detokenize(gen.DetokenizeRequest(token_ids=[t]),
                                           timeout=self.timeout).text for t in tokens]

    # TransformerLens's names for the same (one sequence, no batch dimension).
    def to_tokens(self, text: str, prepend_bos: Optional[bool] = None) -> list:
        """TransformerLens's to_tokens: the ids of `text` (prepend_bos None: the model's
        own setting)."""
        return self.tokenize(text, add_bos=prepend_bos)

    def to_string(self, tokens: Iterable[int]) -> str:
        """TransformerLens's to_string: the text of `tokens`, decoded together."""
        return self.generation.Detokenize(gen.DetokenizeRequest(token_ids=[int(t) for t in tokens]),
                                          timeout=self.timeout).text

    def to_str_tokens(self, text_or_tokens, prepend_bos: Optional[bool] = None) -> list:
        """TransformerLens's to_str_tokens: each token's own text, of a string (tokenized
        first) or of ids."""
        tokens = (self.to_tokens(text_or_tokens, prepend_bos)
                  if isinstance(text_or_tokens, str) else text_or_tokens)
        return self.pieces(tokens)

    def generate(self, text=None, tokens=None, max_new_tokens=32, attention_layers=None,
                 attention_heads=None, chat=None, steering=(), sampling=None, stop=(),
                 min_new_tokens=0, session_id=None, ignore_eos=False):
        """Generation, greedy unless `sampling` (a dict of SamplingParams fields:
        temperature, top_k, top_p, min_p, seed, repetition_penalty, frequency_penalty,
        presence_penalty, logit_bias {token: bias}) says otherwise; `stop` strings end the
        output before them; min_new_tokens holds EOS back until that many tokens;
        ignore_eos keeps going past EOS.
        With attention_layers/heads (lists; [] = all) every token
        comes with its attention row: returns (tokens, text, rows) where rows[i] is a
        [layers, heads, keys] array for generated token i (the layers and heads in the order
        asked; all of them, in order, for []). chat: a conversation instead of
        text, [{"role": "system"|"user"|"assistant", "content": ...}, ...], written by the
        model's chat template (model_info().chat_template), the assistant's turn opened.
        steering: activation steering, dicts added to the residual stream at every
        position: {"hook": "blocks.L.hook_resid_pre"|"..._mid"|"..._post", "vector":
        d_model numbers, "coefficient": c} or {"sae": name, "feature": i, "coefficient": c}
        (a server SAE's decoder direction; list_saes()), each optionally with
        "start_position": p (added from position p on; the prompt's length: the generated
        tokens only; negative: from the prompt's end, -1 its last, so every generated token). session_id (open_session()): the prompt continues that session's
        conversation, of which only the new tokens are computed."""
        req = _generate_request(text, tokens, chat, max_new_tokens, steering, session_id)
        _sampling_and_stopping(req, sampling, stop, min_new_tokens, ignore_eos)
        if attention_layers is not None or attention_heads is not None:
            req.attention_rows.layers.extend(attention_layers or [])
            req.attention_rows.heads.extend(attention_heads or [])
        out_tokens, out_text, rows = [], "", []
        for chunk in self.generation.Generate(req, timeout=self.timeout):
            out_tokens += list(chunk.token_ids)
            out_text += chunk.text
            for row in chunk.attention_rows:
                rows.append(np.asarray(row.probs, dtype=np.float64).reshape(
                    len(row.layers), len(row.heads), row.num_keys))
        return out_tokens, out_text, rows

    def generate_stream(self, text=None, tokens=None, max_new_tokens=32, chat=None,
                        steering=(), sampling=None, stop=(), min_new_tokens=0,
                        session_id=None, ignore_eos=False):
        """generate() as the server streams it: yields a StreamChunk as each arrives, the
        last with its finish_reason. Closing the generator early (close(), or `break` and
        dropping it) cancels the request, whose KV blocks the server frees at once.
        The arguments are generate()'s."""
        req = _generate_request(text, tokens, chat, max_new_tokens, steering, session_id)
        _sampling_and_stopping(req, sampling, stop, min_new_tokens, ignore_eos)
        call = self.generation.Generate(req, timeout=self.timeout)
        try:
            for chunk in call:
                finish = _finish_name(chunk.final) if chunk.HasField("final") else None
                if chunk.token_ids or chunk.text or finish is not None:
                    yield StreamChunk(tokens=list(chunk.token_ids), text=chunk.text,
                                      finish_reason=finish)
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate_scored(self, text=None, tokens=None, max_new_tokens=32, top=0, chat=None,
                        steering=(), sampling=None, stop=(), min_new_tokens=0,
                        session_id=None, ignore_eos=False) -> Generation:
        """generate() with each generated token's log-probability under the model (before
        the draw's penalties, bias and filters, as vLLM's logprobs) and its `top` (0 … 20)
        most likely tokens, and the finish reason ("length", "eos", "stop", "cancelled",
        "context"). The other arguments are generate()'s."""
        req = _generate_request(text, tokens, chat, max_new_tokens, steering, session_id)
        _sampling_and_stopping(req, sampling, stop, min_new_tokens, ignore_eos)
        req.logprobs = True
        req.top_logprobs = top
        tokens, text, entries, finish = [], "", [], ""
        for chunk in self.generation.Generate(req, timeout=self.timeout):
            if len(chunk.logprobs) != len(chunk.token_ids):
                raise RuntimeError("logprobs not parallel to token_ids")
            tokens += list(chunk.token_ids)
            text += chunk.text
            entries += list(chunk.logprobs)
            if chunk.HasField("final"):
                finish = _finish_name(chunk.final)
        return Generation(tokens=tokens, text=text,
                          logprobs=np.array([e.logprob for e in entries], dtype=np.float64),
                          top=[[(t.token, t.logprob) for t in e.top] for e in entries],
                          finish_reason=finish)

    # --- Sessions: a conversation whose KV cache the server keeps between calls ---
    def open_session(self) -> int:
        return self.generation.OpenSession(gen.OpenSessionRequest(),
                                           timeout=self.timeout).session_id

    def close_session(self, session_id: int) -> None:
        self.generation.CloseSession(gen.CloseSessionRequest(session_id=session_id),
                                     timeout=self.timeout)

    @contextlib.contextmanager
    def session(self):
        """with client.session() as sid: ... — the session is closed (its blocks freed)
        on leaving, error or not."""
        session_id = self.open_session()
        try:
            yield session_id
        finally:
            self.close_session(session_id)

    def score(self, text=None, tokens=None, top=0, chat=None, steering=()) -> PromptScores:
        """Scores a prompt on the serving path (Generate's prompt_logprobs, as vLLM's):
        each token's log-probability given the tokens before it, and the `top` (0 … 20)
        most likely tokens at each position. One token is generated and dropped."""
        req = _generate_request(text, tokens, chat, 1, steering)
        req.prompt_logprobs = top
        entries = []
        for chunk in self.generation.Generate(req, timeout=self.timeout):
            if chunk.prompt_logprobs and chunk.prompt_logprobs_position != len(entries) + 1:
                raise RuntimeError("prompt_logprobs out of order")
            entries += list(chunk.prompt_logprobs)
        # Position 0 has no entry: its token is the prompt's first, as Generate encoded it.
        first = list(tokens)[:1] if tokens is not None else self.tokenize(text, chat=chat)[:1]
        return PromptScores(tokens=first + [e.token for e in entries],
                            logprobs=np.array([np.nan] + [e.logprob for e in entries]),
                            top=[[]] + [[(t.token, t.logprob) for t in e.top] for e in entries])

    # --- Interpret ---
    def attention_maps(self, text=None, tokens=None, session_id=None, layers=(), heads=(),
                       queries=(0, 0), keys=(0, 0), scores=False, probabilities=True,
                       fp16=False, fp64=False, summaries=False, induction_period=0,
                       induction_start=0, doc_ids=None, chat=None) -> AttentionMaps:
        """The inputs of every Interpret method: text, tokens, chat (a conversation, as
        generate(chat=...) writes it) or session_id (attention_maps, logit_lens)."""
        req = ip.AttentionMapsRequest(
            input=_input(text, tokens, session_id, doc_ids=doc_ids, chat=chat),
            layers=list(layers),
            heads=list(heads), queries=ip.Range(begin=queries[0], end=queries[1]),
            keys=ip.Range(begin=keys[0], end=keys[1]), scores=scores,
            probabilities_off=not probabilities,
            dtype=ip.DTYPE_FP16 if fp16 else ip.DTYPE_FP32, precision=_precision(fp64),
            head_summaries=summaries, induction_period=induction_period,
            induction_start=induction_start)
        info, probs, sc, summ, chunks = None, None, None, [], 0
        for m in self.interpret.AttentionMaps(req, timeout=self.timeout):
            if m.HasField("info"):
                info = m.info
                shape = (len(info.layers), len(info.heads), info.queries.end - info.queries.begin,
                         info.keys.end - info.keys.begin)
                probs = np.full(shape, np.nan) if probabilities else None
                sc = np.full(shape, np.nan) if scores else None
                layer_index = {l: i for i, l in enumerate(info.layers)}
            if m.HasField("chunk"):
                c = m.chunk
                chunks += 1
                li = layer_index[c.layer]
                q0 = c.query_begin - info.queries.begin
                block = (c.num_heads, c.num_queries, c.num_keys)
                if c.probs:
                    probs[li, :, q0:q0 + c.num_queries, :] = decode(c.probs, c.dtype, block)
                if c.scores:
                    sc[li, :, q0:q0 + c.num_queries, :] = decode(c.scores, c.dtype, block)
            for s in m.head_summaries:
                summ.append(dict(layer=s.layer, head=s.head, entropy=s.entropy,
                                 prev_token=s.prev_token, sink=s.sink, induction=s.induction))
        return AttentionMaps(tokens=list(info.token_ids), layers=list(info.layers),
                             heads=list(info.heads),
                             queries=(info.queries.begin, info.queries.end),
                             keys=(info.keys.begin, info.keys.end),
                             precision=ip.Precision.Name(info.precision), probs=probs,
                             scores=sc, summaries=summ, chunks=chunks)

    def gradient_probe(self, text=None, tokens=None, targets=(), logit_diff=None,
                       attn_out_probe=None, want=("embeddings",), layers=(), heads=(),
                       param_layer=None, fp64=False, verify=0, doc_ids=None,
                       chat=None, hooks=()) -> GradientProbe:
        """targets: [(position, token)] for J = Σ log p (position -1: the last); or
        logit_diff=(position, a, b); or
        attn_out_probe=(layer, head, G [positions, head_dim]). want: any of scores, probs,
        q, k (before RoPE, as TransformerLens's hook_q / hook_k and run_with_cache's q, k),
        rot_q, rot_k (after it; rotary models only), v, attn_out, residual, embeddings,
        attention_times_gradient. hooks: run_with_cache's names (short ones at every layer of
        `layers`, or full ones) whose gradients come back as .grad_cache, TransformerLens's
        gradient cache: every hook but the norms' scale and normalized ones (ln_final, the
        final norm's output, has one); mlp_pre, mlp_post and mlp_pre_linear cost
        3·positions·d_mlp more server memory a layer asked for. verify=K: K entries of each
        tensor kind and of each hook checked by fp64 finite differences; .verify holds the
        largest errors and .verify["tensors"][name] each one's (hooks by their full names; 0
        samples for result, the FFN's hidden hooks and ln_final, which no edit moves alone)."""
        req = ip.GradientProbeRequest(input=_input(text, tokens, doc_ids=doc_ids, chat=chat),
                                      precision=_precision(fp64), layers=list(layers),
                                      heads=list(heads), hooks=list(hooks))
        if logit_diff is not None:
            req.logit_diff.position, req.logit_diff.token_a, req.logit_diff.token_b = logit_diff
        elif attn_out_probe is not None:
            layer, head, g = attn_out_probe
            req.attn_out_probe.layer, req.attn_out_probe.head = layer, head
            req.attn_out_probe.g.extend(np.asarray(g, dtype=np.float64).ravel().tolist())
        else:
            for pos, tok in targets:
                req.log_prob.targets.add(position=pos, token=tok)
        for name in want:
            setattr(req, name, True)
        if param_layer is not None:
            req.param_layer = param_layer
        if verify:
            req.verify, req.verify_samples = True, verify
        r = self.interpret.GradientProbe(req, timeout=self.timeout)
        tensors = {}
        for t in r.tensors:
            tensors.setdefault(t.name, {})[(t.layer, t.head)] = decode(t.data, t.dtype, t.shape)
        verify_report = None
        if r.HasField("verify"):
            verify_report = dict(max_abs_err=r.verify.max_abs_err, max_rel_err=r.verify.max_rel_err,
                                 num_forwards=r.verify.num_forwards,
                                 tensors={t.name: dict(samples=t.samples, max_abs_err=t.max_abs_err,
                                                       max_rel_err=t.max_rel_err)
                                          for t in r.verify.tensors})
        info = self._cached_info()
        grad_cache = _activation_cache(r.hook_gradients, info) if hooks else None
        return GradientProbe(precision=ip.Precision.Name(r.precision), objective=r.objective,
                             tokens=list(r.token_ids), tensors=tensors, verify=verify_report,
                             num_layers=info.num_layers, num_heads=info.num_heads,
                             num_kv_heads=info.num_kv_heads, grad_cache=grad_cache)

    def cached_kv_probe(self, session_id: int, new_tokens: Iterable[int], target: int,
                        fp64: bool = False) -> CachedKvProbe:
        """Gradients with respect to an idle session's cached keys and values, read from the
        server's live cache: J = log p(target | the last of new_tokens), the new tokens
        placed after the P cached ones (and not added to the session)."""
        req = ip.CachedKvProbeRequest(session_id=session_id,
                                      new_tokens=[int(t) for t in new_tokens],
                                      target=int(target), precision=_precision(fp64))
        r = self.interpret.CachedKvProbe(req, timeout=self.timeout)
        tensors = {}
        for t in r.tensors:
            tensors.setdefault(t.name, {})[t.layer] = decode(t.data, t.dtype, t.shape)
        return CachedKvProbe(precision=ip.Precision.Name(r.precision), objective=r.objective,
                             num_cached=r.num_cached, tensors=tensors,
                             num_layers=self._cached_info().num_layers)

    def intervene(self, text=None, tokens=None, ablations=(), mean=False, targets=(),
                  row_overrides=(), patches=(), patch_source=None, fp64=False, chat=None,
                  head_patches=(), neuron_ablations=()):
        """ablations: [(layer, head)]; neuron_ablations: [(layer, neuron)] at every position,
        or [(layer, neuron, position)] at one (TransformerLens's mlp.hook_post[:, pos, i]),
        zeroed or, with mean=True, set to the neuron's mean over the positions as the heads
        are; patches: [(layer, position, source_position)], the
        residual stream entering layer, or [(layer, position, source_position, hook)] at
        another of TransformerLens's sites: "resid_mid", "resid_post", "attn_out",
        "mlp_out"; head_patches: [(layer, head, position, source_position)], one head's
        output z (TransformerLens's attn.hook_z patched by position and head), or
        [(layer, head, position, source_position, hook)] for its "q", or a KV head's "k" or
        "v"; both from patch_source (text or token list). Returns the InterveneResponse
        message."""
        req = ip.InterveneRequest(input=_input(text, tokens, chat=chat),
                                  precision=_precision(fp64))
        for layer, head in ablations:
            req.ablations.add(layer=layer, head=head,
                              mode=ip.HeadAblation.MODE_MEAN if mean else ip.HeadAblation.MODE_ZERO)
        for layer, neuron, *position in neuron_ablations:
            a = req.neuron_ablations.add(
                layer=layer, neuron=neuron,
                mode=ip.HeadAblation.MODE_MEAN if mean else ip.HeadAblation.MODE_ZERO)
            if position:
                a.position = position[0]
        for o in row_overrides:
            req.row_overrides.add(**o)
        for layer, pos, src, *hook in patches:
            req.patches.add(layer=layer, position=pos, source_position=src,
                            hook=hook[0] if hook else "")
        for layer, head, pos, src, *hook in head_patches:
            req.head_patches.add(layer=layer, head=head, position=pos, source_position=src,
                                 hook=hook[0] if hook else "")
        if patch_source is not None:
            req.patch_source.CopyFrom(_input(tokens=patch_source) if not isinstance(patch_source, str)
                                      else _input(text=patch_source))
        for pos, tok in targets:
            req.targets.add(position=pos, token=tok)
        return self.interpret.Intervene(req, timeout=self.timeout)

    def patch_sweep(self, text=None, tokens=None, patch_source=None, hook="resid_pre",
                    layers=(), positions=(0, 0), targets=(), logit_diff=None, fp64=False,
                    chat=None, all_positions=False, attribution=False,
                    more_pairs=(), per_pair=False, qk_fix=False) -> PatchSweep:
        """Activation patching over layers × positions, as TransformerLens's patching module
        (get_act_patch_resid_pre, …): each cell runs this prompt with `hook` (resid_pre,
        resid_mid, resid_post, attn_out, mlp_out, or per head q, z or pattern, per KV head k
        or v) of one layer at one position taken from patch_source (text or token list, the
        same length) at that position, and scores it: targets [(position, token)] for
        Σ log p, or logit_diff=(position, a, b). layers: empty for all (negative from the end); positions: [begin, end), (0, 0) all;
        all_positions: one cell per layer (and head) patching every position at once
        (TransformerLens's …_all_pos), metric [layers(, heads)]; attribution: every cell
        estimated by attribution patching (clean + (source - clean) · gradient) from one
        backward pass instead of a forward per cell; qk_fix (with attribution, hook q or k):
        AtP*'s QK fix, each cell's attention pattern recomputed exactly and only its effect
        taken to first order. more_pairs: more prompt pairs of a
        dataset, each a dict(text= or tokens=, patch_source=, targets= or logit_diff=) of the
        same length, its own names scored; metric, clean and source are then the means over
        all pairs (a batch with a mean metric); per_pair: each pair's own as well
        (pair_clean, pair_source, pair_metric; pair_recovered())."""
        if patch_source is None:
            raise ValueError("patch_sweep: patch_source is required")
        req = ip.PatchSweepRequest(
            input=_input(text, tokens, chat=chat), hook=hook, layers=list(layers),
            positions=ip.Range(begin=positions[0], end=positions[1]), precision=_precision(fp64),
            all_positions=all_positions, attribution=attribution, per_pair=per_pair,
            qk_fix=qk_fix)
        _fill_pair(req, patch_source, targets, logit_diff)
        for k, p in enumerate(more_pairs):
            unknown = set(p) - {"text", "tokens", "patch_source", "targets", "logit_diff"}
            if unknown or "patch_source" not in p:
                raise ValueError(f"patch_sweep: more_pairs[{k}] takes text= or tokens=, "
                                 f"patch_source= and targets= or logit_diff= (got {sorted(p)})")
            pair = req.more_pairs.add(input=_input(p.get("text"), p.get("tokens")))
            _fill_pair(pair, p["patch_source"], p.get("targets", ()), p.get("logit_diff"))
        r = self.interpret.PatchSweep(req, timeout=self.timeout)
        shape = [len(r.layers), r.num_heads, 1 if all_positions else
                 r.positions.end - r.positions.begin]

        def grid(values):
            m = np.asarray(values, dtype=np.float64).reshape(shape)
            if all_positions:
                m = m[:, :, 0]
            return m if hook in _HEAD_HOOKS else m[:, 0]

        per = dict(pair_clean=np.array([p.clean for p in r.pairs]),
                   pair_source=np.array([p.source for p in r.pairs]),
                   pair_metric=np.stack([grid(p.metric) for p in r.pairs])) if r.pairs else {}
        return PatchSweep(precision=ip.Precision.Name(r.precision), hook=hook or "resid_pre",
                          layers=list(r.layers), positions=(r.positions.begin, r.positions.end),
                          clean=r.clean, source=r.source, metric=grid(r.metric),
                          num_pairs=r.num_pairs, **per)

    def logit_lens(self, text=None, tokens=None, positions=(), top_k=5, fp64=False, chat=None,
                   session_id=None):
        req = ip.LogitLensRequest(input=_input(text, tokens, session_id, chat=chat),
                                  positions=list(positions),
                                  top_k=top_k, precision=_precision(fp64))
        return self.interpret.LogitLens(req, timeout=self.timeout)

    def run_with_cache(self, text=None, tokens=None, hooks=None, layers=(),
                       positions=(0, 0), fp64=False, fp16=False, chat=None, session_id=None,
                       doc_ids=None, names_filter=None) -> ActivationCache:
        """Activations under TransformerLens's hook names: returns {"hook.layer": array}
        (an ActivationCache: also cache["hook", layer], the layer from the end when negative,
        and cache["blocks.1.attn.hook_pattern"]) (e.g. "resid_pre.3" [positions, d_model],
        "z.0" [positions, H, d_head], "pattern.1" [H, positions, keys] head first as
        TransformerLens's; "ln_final" has no layer).
        hooks: resid_pre, resid_mid, resid_post, attn_out, mlp_out, z, result, q, k (before
        RoPE, as TransformerLens's), v, rot_q, rot_k (after it; rotary models only), mlp_pre,
        mlp_post, mlp_pre_linear (a gated FFN's up projection), attn_scores, pattern,
        ln1_scale, ln1_normalized, ln2_scale, ln2_normalized, and Gemma 2/3's ln1_post_…,
        ln2_post_… (each norm's divisor [positions, 1] and its input over it, before the
        weight),
        each at every layer in `layers`; ln_final (the final norm's output), ln_final_scale,
        ln_final_normalized, embed, pos_embed (GPT-2); or full names, each at its own layer:
        "blocks.1.attn.hook_pattern", "blocks.0.ln1.hook_scale", "ln_final.hook_normalized".
        Default: resid_pre.
        names_filter, instead of hooks and layers, as TransformerLens's: a full name, a list
        of them, or a function of one (lambda name: name.endswith("hook_pattern")) choosing
        among hook_names()."""
        if names_filter is not None:
            if hooks is not None or layers:
                raise ValueError("run_with_cache: give names_filter or hooks/layers, not both")
            if isinstance(names_filter, str):
                hooks = [names_filter]
            elif callable(names_filter):
                hooks = [n for n in self.hook_names() if names_filter(n)]
            else:
                hooks = list(names_filter)
            if not hooks:
                raise ValueError("run_with_cache: names_filter chooses no hook")
        elif hooks is None:
            hooks = ("resid_pre",)
        req = ip.ActivationsRequest(
            input=_input(text, tokens, session_id, doc_ids=doc_ids, chat=chat), hooks=list(hooks),
            layers=list(layers), positions=ip.Range(begin=positions[0], end=positions[1]),
            precision=_precision(fp64),
            dtype=ip.DTYPE_FP16 if fp16 else ip.DTYPE_UNSPECIFIED)
        r = self.interpret.Activations(req, timeout=self.timeout)
        return _activation_cache(r.tensors, self._cached_info())

    def logit_attribution(self, text=None, tokens=None, token=0, baseline_token=None,
                          position=None, heads=False, top_neurons=0, fp64=False, chat=None,
                          session_id=None):
        """Direct logit attribution of logit[token] (− logit[baseline_token]) at `position`
        (default: the last). Returns the LogitAttributionResponse message: components sum
        to total (≈ logit); heads and neurons split each layer's attn and mlp."""
        req = ip.LogitAttributionRequest(input=_input(text, tokens, session_id, chat=chat),
                                         token=token, heads=heads, top_neurons=top_neurons,
                                         precision=_precision(fp64))
        if position is not None:
            req.position = position
        if baseline_token is not None:
            req.baseline_token = baseline_token
        return self.interpret.LogitAttribution(req, timeout=self.timeout)

    def list_saes(self):
        """The sparse autoencoders the server loaded (kvlens-server --sae): SaeInfo messages."""
        return list(self.interpret.ListSaes(ip.ListSaesRequest(), timeout=self.timeout).saes)

    def sae_features(self, text=None, tokens=None, sae="", positions=(0, 0), top_k=10,
                     feature_ids=(), fp64=False, chat=None, session_id=None):
        """An SAE's features per position: the SaeFeaturesResponse message (rows[i].top:
        strongest features; rows[i].features: the activations of feature_ids; l0,
        reconstruction_mse, relative_error)."""
        req = ip.SaeFeaturesRequest(input=_input(text, tokens, session_id, chat=chat), sae=sae,
                                    positions=ip.Range(begin=positions[0], end=positions[1]),
                                    top_k=top_k, feature_ids=list(feature_ids),
                                    precision=_precision(fp64))
        return self.interpret.SaeFeatures(req, timeout=self.timeout)
