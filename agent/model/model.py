"""A compact MoE decoder (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral) whose routed experts stream from a provider.

Reads top to bottom like gpt-fast's model.py. Shapes: T tokens in a step (all sequences together),
D hidden, H / Hkv query / key-value heads, Dh head dim, E experts, k top-k, V vocab.

Continuous batching: a `Sequence` owns one request's KV cache. `Transformer.step` takes several
sequences, each with one or more new tokens (prefill and decode may share a step), runs attention
per sequence and each MoE layer over all T tokens at once, so the whole batch shares one
`provider.route(layer, union of chosen experts)` and one load per expert. route() may return the
order in which the provider wants the experts asked for (a cache: the resident ones first); the
outputs are summed in the same order whatever it is.

Lookahead prefetch: once layer L has routed, layer L+1's router is applied to L+1's own
post-attention RMSNorm of the residual stream entering L's MoE (layer L+1's attention and L's
expert output are not known yet, so this is the best guess available before L's experts run),
and the union of its top-k choices is passed to `provider.prefetch`. The residual stream changes
little from one layer to the next, which is what makes the guess useful.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from agent.experts.layout import CONFIG, DENSE, INDEX, Index, StoreError
from agent.experts.provider import ExpertProvider
from agent.model.config import ConfigError, MoEConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the model dtype (as transformers does).
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, Dh] for the given absolute positions (half-split layout of the HF checkpoints)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)  # [Dh/2]
    freqs = positions[:, None].float() * inv_freq                                        # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                              # [T, Dh]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, Dh] rotated by the angles of its token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Sequence:
    """One request's KV cache: two buffers [layers, max_len, Hkv, Dh] allocated once, and its length."""

    def __init__(self, config: MoEConfig, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        shape = (config.n_layers, max_len, config.n_kv_heads, config.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.max_len, self.pos = max_len, 0

    def write(self, layer: int, pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [n, Hkv, Dh] at pos..pos+n; return every key and value so far [pos+n, Hkv, Dh]."""
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


class Attention(nn.Module):
    def __init__(self, c: MoEConfig, window: int | None) -> None:
        super().__init__()
        self.c, self.window = c, window
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.o_bias)
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
        q, k, v = q.view(T, c.n_heads, c.head_dim), k.view(T, c.n_kv_heads, c.head_dim), v.view(T, c.n_kv_heads, c.head_dim)
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


class MLP(nn.Module):
    """SwiGLU; the dense MLP of non-MoE layers and Qwen2-MoE's shared expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class Routing:
    weights: Tensor  # [T, k] gate weight of each chosen expert
    ids: Tensor      # [T, k] chosen expert ids

    @cached_property
    def assignments(self) -> dict[int, tuple[Tensor, Tensor]]:
        """expert -> (tokens that chose it, at which of their k ranks), experts ascending."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for t, row in enumerate(self.ids.tolist()):
            for rank, e in enumerate(row):
                groups.setdefault(e, ([], []))[0].append(t)
                groups[e][1].append(rank)
        return {e: (torch.tensor(groups[e][0]), torch.tensor(groups[e][1])) for e in sorted(groups)}

    @property
    def experts(self) -> list[int]:
        """The union over the step's tokens, ascending: what the provider is routed."""
        return list(self.assignments)


class Router(nn.Module):
    """Softmax over all experts, then top-k, then (if the architecture says so) renormalise to sum 1."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = c.top_k, c.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(c.n_experts, c.dim))

    def forward(self, h: Tensor) -> Routing:
        probs = F.softmax(F.linear(h, self.weight).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)           # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights.to(h.dtype), ids)


def run_experts(h: Tensor, routing: Routing, provider: ExpertProvider, layer: int, order: Seq[int]) -> Tensor:
    """Sum over each token's chosen experts of gate weight x SwiGLU(expert weights from the provider).

    Experts are fetched in `order` (the provider's choice); their outputs are summed in ascending
    expert order, so the result does not depend on what the cache held."""
    # index_select / index_put_ rather than h[tok] / index_add_: the latter cost ~1 ms a call on a busy CPU.
    outputs: dict[int, Tensor] = {}
    for e in order:
        tok, rank = routing.assignments[e]
        expert = provider.get(layer, e)                                # SwiGLU of its weights, plain or int8
        y = expert(h.index_select(0, tok))                             # [t, D]
        outputs[e] = y * routing.weights[tok, rank, None]
    out = torch.zeros_like(h)                                          # [T, D]
    for e in sorted(outputs):
        out.index_put_((routing.assignments[e][0],), outputs[e], accumulate=True)
    return out


class MoE(nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(c)
        if c.shared_expert_dim:
            self.shared_expert = MLP(c.dim, c.shared_expert_dim)
            self.shared_expert_gate = nn.Linear(c.dim, 1, bias=False)

    def forward(self, h: Tensor, routing: Routing, provider: ExpertProvider, layer: int, order: Seq[int]) -> Tensor:
        out = run_experts(h, routing, provider, layer, order)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out


class Block(nn.Module):
    def __init__(self, c: MoEConfig, i: int) -> None:
        super().__init__()
        self.self_attn = Attention(c, c.sliding_window[i])
        self.mlp = MoE(c) if c.moe_layers[i] else MLP(c.dim, c.dense_dim)
        self.input_layernorm = RMSNorm(c.dim, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.dim, c.rms_eps)


@dataclass
class Lookahead:
    """Prefetch accuracy: of the experts predicted for a layer, how many its real routing then used."""
    predicted: int = 0
    correct: int = 0
    _pending: dict[int, set[int]] = field(default_factory=dict)

    def predict(self, layer: int, experts: list[int]) -> None:
        self._pending[layer] = set(experts)
        self.predicted += len(experts)

    def score(self, layer: int, routed: list[int]) -> None:
        self.correct += len(self._pending.pop(layer, set()) & set(routed))

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None


class Transformer(nn.Module):
    def __init__(self, config: MoEConfig, provider: ExpertProvider, prefetch: bool = True) -> None:
        super().__init__()
        self.config, self.provider, self.prefetch = config, provider, prefetch
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.store_layer = {d: i for i, d in enumerate(config.moe_layer_ids)}  # decoder layer -> store layer
        self.lookahead = Lookahead()

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
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self.embed_tokens(tokens)                                                   # [T, D]
        for i, block in enumerate(self.layers):
            x = x + block.self_attn(block.input_layernorm(x), i, segments, rope)
            x = x + self._ffn(i, block, x)
        x = self.norm(x)
        for s in segments:
            s.seq.pos += s.n
        if all_logits:
            return [self.lm_head(x[s.start:s.start + s.n]).float() for s in segments]
        last = torch.tensor([s.start + s.n - 1 for s in segments])
        return list(self.lm_head(x[last]).float())                                       # B x [V]

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

    def _ffn(self, i: int, block: Block, x: Tensor) -> Tensor:
        h = block.post_attention_layernorm(x)                                           # [T, D]
        if not isinstance(block.mlp, MoE):
            return block.mlp(h)
        layer = self.store_layer[i]
        routing = block.mlp.gate(h)
        experts = routing.experts
        order = self.provider.route(layer, experts) or experts  # a cache may answer the order it wants
        self.lookahead.score(layer, experts)
        if self.prefetch:
            self._prefetch_next(i, x)
        return block.mlp(h, routing, self.provider, layer, order)

    def _prefetch_next(self, i: int, x: Tensor) -> None:
        """Guess layer i+1's experts from the residual stream x entering layer i's MoE (see module doc)."""
        if i + 1 not in self.store_layer:
            return
        nxt = self.layers[i + 1]
        experts = nxt.mlp.gate(nxt.post_attention_layernorm(x)).experts
        self.lookahead.predict(self.store_layer[i + 1], experts)
        self.provider.prefetch(self.store_layer[i + 1], experts)

    @classmethod
    def from_store(cls, store_dir: Path, provider: ExpertProvider, prefetch: bool = True) -> "Transformer":
        """Load config.json and dense.safetensors of an expert store; routed experts come from provider."""
        store_dir = Path(store_dir)
        config = MoEConfig.from_file(store_dir / CONFIG)
        check_index(config, Index.load(store_dir / INDEX))
        return cls.from_state(config, dense_state(config, store_dir / DENSE), provider, prefetch)

    @classmethod
    def from_state(cls, config: MoEConfig, state: dict[str, Tensor], provider: ExpertProvider,
                   prefetch: bool = True) -> "Transformer":
        with torch.device("meta"):  # no allocation: the loaded tensors are assigned as they are
            model = cls(config, provider, prefetch)
        check_state(model, state)
        model.load_state_dict(state, assign=True)
        return model.eval()


def check_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    own = {k: v.shape for k, v in model.state_dict().items()}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in own.items() if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        raise StoreError(f"dense weights do not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                         f"wrong shape {wrong[:5]}; re-run flashmoe-cli convert on the checkpoint this config belongs to")


def check_index(config: MoEConfig, index: Index) -> None:
    """The expert store must hold one block per (MoE layer, expert) of the shape config.json implies."""
    want = (len(config.moe_layer_ids), config.n_experts, config.dim, config.expert_dim)
    got = (index.n_layers, index.n_experts, index.hidden, index.intermediate)
    if want != got:
        raise ConfigError(f"config.json implies (MoE layers, experts, hidden, expert intermediate) = {want} but "
                          f"experts.index.json has {got}; re-run flashmoe-cli convert")


def dense_state(config: MoEConfig, path: Path) -> dict[str, Tensor]:
    """dense.safetensors (transformers' save_pretrained names) renamed to this module's parameter names."""
    if not path.exists():
        raise StoreError(f"{path} is missing; re-run flashmoe-cli convert")
    return hf_to_state(config, load_file(str(path)))


def hf_to_state(config: MoEConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename transformers' non-expert tensor names to ours: drop "model.", Mixtral's block_sparse_moe is mlp."""
    state = {k.removeprefix("model.").replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()}
    if config.tie_embeddings and "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state
