"""A compact MoE decoder (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2) whose routed experts stream
from a provider.

Reads top to bottom like gpt-fast's model.py. Shapes: T tokens in a step (all sequences together),
D hidden, H / Hkv query / key-value heads, Dh head dim, E experts, k top-k, V vocab.

Continuous batching: a `Sequence` owns one request's KV cache. `Transformer.step` takes several
sequences, each with one or more new tokens (prefill and decode may share a step), runs attention
per sequence and each MoE layer over all T tokens at once, so the whole batch shares one
`provider.route(layer, union of chosen experts)` and one load per expert (agent/model/routed.py).
Lookahead prefetch is its own part (agent/model/lookahead.py); loading a model from an expert
store and checking it is agent/model/loading.py.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agent.bf16_matvec import linear
from agent.experts.provider import ExpertProvider
from agent.model.config import MoEConfig
from agent.model.lookahead import CoActivation, Guess, Lookahead, RouterGuess
from agent.model.profile import Profile
from agent.model.rope import apply_rope, deinterleave, rope_tables
from agent.model.route_trace import Placement, RouteTrace
from agent.model.routed import RoutedExperts, Routing
from agent.workers import Workers


class Linear(nn.Linear):
    """A dense linear: nn.Linear whose one-token bf16 steps take the compiled matvec (agent/bf16_matvec.py);
    a model loaded with dense="int8" has an Int8Linear in its place (agent/model/dense_int8.py)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the model dtype (as transformers does).
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Sequence:
    """One request's KV cache: two buffers [layers, max_len, Hkv, Dk or Dv] allocated once, and its length.
    MLA caches what its keys and values come from instead: k the latent, v the rotary key (one "head")."""

    def __init__(self, config: MoEConfig, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        heads, k_dim, v_dim = config.kv_cache_shape
        self.k = torch.zeros(config.n_layers, max_len, heads, k_dim, dtype=dtype)
        self.v = torch.zeros(config.n_layers, max_len, heads, v_dim, dtype=dtype)
        self.max_len, self.pos = max_len, 0
        self.route: Placement | None = None  # where it follows a route trace, if the model has one

    def write(self, layer: int, pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k [n, Hkv, Dk], v [n, Hkv, Dv] at pos..pos+n; return every key and value so far [pos+n, Hkv, D]."""
        end = pos + k.shape[0]
        self.k[layer, pos:end], self.v[layer, pos:end] = k, v
        return self.k[layer, :end], self.v[layer, :end]


@dataclass
class Segment:
    """Where one sequence's new tokens sit in a step's flat token axis."""
    seq: Sequence
    start: int
    n: int
    pos: int  # absolute position of the first new token

    def mask(self, window: int | None) -> Tensor:
        """[n, pos+n] True where query i may attend key j: causal, and within the sliding window if any.

        A window is applied here only; the KV cache still keeps every position (simple, and our
        sequences are far shorter than the windows of the supported checkpoints)."""
        q = torch.arange(self.pos, self.pos + self.n)[:, None]
        kv = torch.arange(self.pos + self.n)[None, :]
        allowed = kv <= q
        return allowed & (q - kv < window) if window else allowed


@dataclass
class Step:
    """What every block needs to know about the step it runs in."""
    segments: list[Segment]
    rope: tuple[Tensor, Tensor]      # cos, sin [T, Dh]
    routes: Tensor | None = None     # [T, MoE layers, k] experts a route trace imposes on each token


class Attention(nn.Module):
    def __init__(self, c: MoEConfig, window: int | None) -> None:
        super().__init__()
        self.c, self.window = c, window
        self.q_proj = Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.dim, bias=c.o_bias)
        if c.qk_norm == "full":  # OLMoE: over the whole projection
            self.q_norm = RMSNorm(c.n_heads * c.head_dim, c.rms_eps)
            self.k_norm = RMSNorm(c.n_kv_heads * c.head_dim, c.rms_eps)
        elif c.qk_norm == "head":  # Qwen3: per head
            self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.rms_eps), RMSNorm(c.head_dim, c.rms_eps)

    def forward(self, x: Tensor, layer: int, segments: list[Segment], rope: tuple[Tensor, Tensor]) -> Tensor:
        c, T = self.c, x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)      # [T, H*Dh], [T, Hkv*Dh] x2
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(T, c.n_heads, c.head_dim)                                             # [T, H, Dh]
        k, v = k.view(T, c.n_kv_heads, c.head_dim), v.view(T, c.n_kv_heads, c.head_dim)  # [T, Hkv, Dh]
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = torch.empty_like(q)                                        # [T, H, Dh]
        for s in segments:
            rows = slice(s.start, s.start + s.n)
            keys, values = s.seq.write(layer, s.pos, k[rows], v[rows])  # [S, Hkv, Dh]
            out[rows] = self.attend(q[rows], keys, values, s.mask(self.window))
        return self.o_proj(out.view(T, -1))

    @staticmethod
    def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """q [n, H, Dh] over keys/values [S, Hkv, Dh] with mask [n, S] -> [n, H, Dh].

        Plain matmul-softmax (transformers' eager path): at decode sizes it is ~40x faster than
        F.scaled_dot_product_attention on a CPU shared with other work, whose kernel spreads tiny
        heads over threads."""
        group = q.shape[1] // keys.shape[1]                                  # query heads per kv head (GQA)
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)             # [H, S, Dh]
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)           # [H, S, Dh]
        scores = q.transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # [H, n, S]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
        return (probs @ v).transpose(0, 1)                                   # [n, H, Dh]


class LatentAttention(nn.Module):
    """DeepSeek-V2's MLA (config.MLAConfig). Every head's key and value are kv_b_proj of one normalised
    latent per token; the cache holds that latent and the rotary key shared by all heads (576 numbers per
    token and layer in Lite, not 16 heads x 320), and kv_b_proj is folded into the query (keys) and the
    output (values), so no step expands the cache."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.c, m = c, c.mla
        q_out = c.n_heads * c.k_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(c.dim, q_out, bias=False)
        else:
            self.q_a_proj = Linear(c.dim, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.dim, m.kv_lora_rank + m.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        # never called: its weight is folded into the query and the output (forward), so not a dense Linear
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, c.n_heads * (m.nope_dim + m.v_dim), bias=False)
        self.o_proj = Linear(c.n_heads * m.v_dim, c.dim, bias=False)
        self.scale = c.k_head_dim ** -0.5 * (c.yarn.softmax_scale if c.yarn else 1.0)

    def forward(self, x: Tensor, layer: int, segments: list[Segment], rope: tuple[Tensor, Tensor]) -> Tensor:
        c, m, T = self.c, self.c.mla, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, c.n_heads, c.k_head_dim).split([m.nope_dim, m.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)                                   # [T, R]
        q_rope = apply_rope(deinterleave(q_rope), *rope)                       # [T, H, Dr]
        k_rope = apply_rope(deinterleave(k_rope)[:, None], *rope)              # [T, 1, Dr]: one for all heads
        up = self.kv_b_proj.weight.view(c.n_heads, m.nope_dim + m.v_dim, m.kv_lora_rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, up[:, :m.nope_dim])    # [T, H, R]: q_nope . k_nope
        context = q.new_empty(T, c.n_heads, m.kv_lora_rank)                    # [T, H, R]
        for s in segments:
            rows = slice(s.start, s.start + s.n)
            latents, ropes = s.seq.write(layer, s.pos, latent[rows, None], k_rope[rows])  # [S, 1, R], [S, 1, Dr]
            scores = (q_latent[rows] @ latents[:, 0].T + q_rope[rows] @ ropes[:, 0].T) * self.scale  # [n, H, S]
            probs = torch.softmax(scores.masked_fill(~s.mask(None)[:, None], float("-inf")).float(), dim=-1)
            context[rows] = probs.to(q.dtype) @ latents[:, 0]
        out = torch.einsum("thr,hvr->thv", context, up[:, m.nope_dim:])      # [T, H, Dv]
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    """SwiGLU; the dense MLP of non-MoE layers and Qwen2-MoE's shared expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over all experts, then top-k (DeepSeek-V2: within the best expert groups), then (if the
    architecture says so) renormalise to sum 1, and scale."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.scale = c.top_k, c.norm_topk_prob, c.routed_scale
        self.groups = c.expert_groups
        self.weight = nn.Parameter(torch.empty(c.n_experts, c.dim))

    def forward(self, h: Tensor, imposed: Tensor | None = None) -> Routing:
        """Route h [T, D]; `imposed` [T, k] (a route trace) replaces the top-k choice, not the softmax."""
        probs = F.softmax(linear(h, self.weight).float(), dim=-1)  # [T, E]
        if imposed is None:
            weights, ids = torch.topk(self._in_best_groups(probs), self.top_k, dim=-1)  # [T, k]
        else:
            weights, ids = probs.gather(-1, imposed), imposed
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing((weights * self.scale).to(h.dtype), ids)

    def _in_best_groups(self, probs: Tensor) -> Tensor:
        """probs [T, E] with the experts outside each token's topk_group best groups zeroed (as transformers)."""
        if self.groups is None:
            return probs
        n_group, topk_group = self.groups
        best = probs.view(probs.shape[0], n_group, -1).amax(dim=-1)                       # [T, G]
        keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1).indices, 1.0)
        return probs * keep.repeat_interleave(probs.shape[1] // n_group, dim=1)


class MoE(nn.Module):
    """Routed experts from the provider, plus Qwen2-MoE's gated shared expert or DeepSeek-V2's shared experts."""

    def __init__(self, c: MoEConfig, layer: int, experts: RoutedExperts) -> None:
        super().__init__()
        self.layer, self.experts = layer, experts    # store layer; the model's access to the provider
        self.gate = Router(c)
        self.shared_expert = MLP(c.dim, c.shared_expert_dim) if c.shared_expert_dim else None
        self.shared_expert_gate = nn.Linear(c.dim, 1, bias=False) if c.shared_expert_dim else None
        self.shared_experts = MLP(c.dim, c.shared_experts_dim) if c.shared_experts_dim else None

    def forward(self, h: Tensor, residual: Tensor, routes: Tensor | None) -> Tensor:
        """h [T, D] normalised; `residual` [T, D] the stream it came from (for the lookahead's guess)."""
        with self.experts.profile.phase("router"):
            routing = self.gate(h, None if routes is None else routes[:, self.layer])
        out = self.experts(self.layer, h, routing, residual)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out


class Block(nn.Module):
    def __init__(self, c: MoEConfig, i: int, store_layer: int | None, experts: RoutedExperts) -> None:
        super().__init__()
        self.i, self.profile = i, experts.profile
        self.self_attn = LatentAttention(c) if c.mla else Attention(c, c.sliding_window[i])
        self.mlp = MLP(c.dim, c.dense_dim) if store_layer is None else MoE(c, store_layer, experts)
        self.input_layernorm = RMSNorm(c.dim, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.dim, c.rms_eps)

    def forward(self, x: Tensor, step: Step) -> Tensor:
        with self.profile.phase("attention"):
            x = x + self.self_attn(self.input_layernorm(x), self.i, step.segments, step.rope)   # [T, D]
            h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, x, step.routes) if isinstance(self.mlp, MoE) else self.mlp(h))

    def guess(self) -> Guess:
        """How to guess this MoE block's experts from a residual stream [T, D]: its router after its norm.
        The guess holds those two modules, not the block: a block leads to the lookahead (through its
        experts), so a bound method would close a cycle that keeps the model, and an mmap store's
        mapping, alive after use until the garbage collector runs."""
        norm, gate = self.post_attention_layernorm, self.mlp.gate
        return lambda residual: gate(norm(residual)).ranked


class Transformer(nn.Module):
    def __init__(self, config: MoEConfig, provider: ExpertProvider, prefetch: bool = True, workers: int = 1) -> None:
        """`workers`: the threads a one-token step computes on (agent/workers.py), its own one of them."""
        super().__init__()
        self.config = config
        store_layer = {d: i for i, d in enumerate(config.moe_layer_ids)}  # decoder layer -> store layer
        self.lookahead, self.profile, self.workers = Lookahead(RouterGuess({}), prefetch), Profile(), Workers(workers)
        self.experts = RoutedExperts(provider, self.lookahead, self.profile, self.workers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i, store_layer.get(i), self.experts) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_eps)
        self.lm_head = Linear(config.dim, config.vocab_size, bias=False)
        self.lookahead.predictor.guesses = {store_layer[d]: self.layers[d + 1].guess()
                                            for d in store_layer if d + 1 in store_layer}
        self.route_trace: RouteTrace | None = None

    def follow(self, trace: RouteTrace) -> None:
        """Take every token's experts from `trace` from now on. The router cannot predict imposed
        routing, so the lookahead learns which experts follow which across layers instead."""
        self.route_trace = trace
        self.lookahead.predictor = CoActivation(len(self.config.moe_layer_ids), self.config.n_experts)

    @property
    def prefetch(self) -> bool:
        return self.lookahead.enabled

    @prefetch.setter
    def prefetch(self, on: bool) -> None:
        self.lookahead.enabled = on

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_sequence(self, max_len: int) -> Sequence:
        return Sequence(self.config, max_len, self.dtype)

    @torch.inference_mode()
    def step(self, batch: Seq[tuple[Sequence, Tensor]], all_logits: bool = False) -> list[Tensor]:
        """Run each sequence's new tokens [n_i]; return its last logits [V] (or all of them [n_i, V])."""
        segments = self._segments(batch)
        tokens = torch.cat([t.view(-1) for _, t in batch])                              # [T]
        positions = torch.cat([torch.arange(s.pos, s.pos + s.n) for s in segments])    # [T]
        step = Step(segments, rope_tables(positions, self.config, self.dtype),
                    self._imposed_routes(batch, segments))
        with self.workers.splitting():
            with self.profile.phase("head"):
                x = self.embed_tokens(tokens)                                           # [T, D]
            for block in self.layers:
                x = block(x, step)
            for s in segments:
                s.seq.pos += s.n
            with self.profile.phase("head"):
                x = self.norm(x)
                if all_logits:
                    return [self.lm_head(x[s.start:s.start + s.n]).float() for s in segments]
                last = torch.tensor([s.start + s.n - 1 for s in segments])
                return list(self.lm_head(x[last]).float())                               # B x [V]

    def _imposed_routes(self, batch: Seq[tuple[Sequence, Tensor]], segments: list[Segment]) -> Tensor | None:
        """[T, MoE layers, k] from the route trace, if any; a new sequence is placed by its first tokens."""
        if self.route_trace is None:
            return None
        for (seq, tokens), s in zip(batch, segments):
            seq.route = seq.route or self.route_trace.place(tokens.view(-1))
        return torch.cat([self.route_trace.experts(s.seq.route, s.pos, s.n) for s in segments])

    def _segments(self, batch: Seq[tuple[Sequence, Tensor]]) -> list[Segment]:
        segments, start = [], 0
        for seq, tokens in batch:
            n = tokens.numel()
            if n == 0 or seq.pos + n > seq.max_len:
                raise ValueError(f"a sequence at position {seq.pos} cannot take {n} new tokens "
                                 f"(KV cache holds {seq.max_len}); give at least one token and a larger max_len")
            segments.append(Segment(seq, start, n, seq.pos))
            start += n
        return segments
