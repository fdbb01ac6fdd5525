"""Gated-delta-net linear-attention layers (Qwen3-Next, Qwen3.5) under Ulysses SP, restarted at every document.

Hybrid models mix `linear_attention` layers (a causal depthwise conv1d over the q/k/v channels, then the gated
delta rule: a recurrent state [heads, dk, dv] per sequence) with full attention. `install(model, group)` replaces
each linear-attention module's forward by `_forward`, which:
- projects this rank's tokens (per token: [bs, sl/sp, hidden] -> q, k [bs, sl/sp, nk, dk], v, z [.., nv, dv],
  b, a [.., nv]), then ONE all-to-all over the SP group turns the sequence shards into head shards
  [bs, sl, nk/sp | nv/sp, ..]: every rank then holds the FULL sequence of its heads, so the conv and the recurrence
  see everything. Heads split contiguously: k head i serves v heads i*r..i*r+r-1 (r = nv/nk, transformers'
  repeat_interleave), so rank j's k heads [j*nk/sp, ..) and v heads [j*nv/sp, ..) belong together; the conv's
  channels are [q (nk, dk) | k (nk, dk) | v (nv, dv)], so the rank takes those three slices of the conv weight.
- runs the conv and the gated delta rule on its heads, the gated RMSNorm (per head, with z), then ONE all-to-all
  back [bs, sl, nv/sp, dv] -> [bs, sl/sp, nv, dv] before the output projection. Both all-to-alls are per layer,
  each (2 nk dk + 2 nv dv + 2 nv) / hidden and nv dv / hidden times the layer input's bytes.
- restarts the conv and the recurrent state at every packed document (position ids restarting: the rule of
  model_utils/attention.Documents), at every SP degree, also sp == 1. transformers does not: its linear layers
  never see position_ids, so on CPU (torch fallback) a packed sample's state flows across documents, and on GPU
  (fla) only a `cu_seq_lens_q` kwarg would stop it. Cost here: the conv becomes K (= 4) shifted multiply-adds with
  a [bs, sl] validity mask per shift instead of one conv1d (only when a sample restarts); the chunked rule gets a
  segment mask per chunk ([C, C] per chunk, the size of its decay matrix; C = 64), so it stays one pass with no
  per-document loop and no padding per document. The document starts are gathered and tested (one host sync)
  once per micro-batch, shared by every linear layer and the recompute.
On a GPU with `fla` installed the recurrence runs fla's chunk_gated_delta_rule with cu_seqlens (the documents
as varlen rows); UNTESTED here (no GPU). Context parallelism is refused for these models (`check_layout`): the
recurrence of a cp shard would need the state at the end of the previous shard.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from base import comm
from model_utils.families import LINEAR_MODEL_TYPES

# LINEAR_MODEL_TYPES: the types whose linear_attention layers are transformers' GatedDeltaNet (this module's `_forward`);
# other linear-attention families (Kimi-Linear's KDA, OLMo-hybrid, Mamba hybrids) stay refused by check_supported
CHUNK = 64  # the chunked rule's chunk length (transformers' and fla's default)

_STATE: dict = {"modules": set()}  # id of every linear-attention module that ran through `_forward` (check_routed)
_POS: list = []  # [(local position ids, version, (starts [bs, sl] bool or None))], newest last


def _text(cfg):
    cfg = getattr(cfg, "config", cfg)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def is_hybrid(cfg) -> bool:
    """Whether the model (or config) has linear-attention layers."""
    return "linear_attention" in (getattr(_text(cfg), "layer_types", None) or ())


def supported_layer_types(cfg) -> tuple[str, ...]:
    """The layer types beyond full / sliding attention this module makes sequence-parallel for `cfg`."""
    return ("linear_attention",) if _text(cfg).model_type in LINEAR_MODEL_TYPES else ()


def check_layout(cfg, sp: int, cp: int) -> None:
    """One-line ValueError when (sp, cp) cannot run the linear-attention layers of `cfg` (nothing for other models)."""
    cfg = _text(cfg)
    if not is_hybrid(cfg):
        return
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if cp > 1:
        raise ValueError(f"{cfg.model_type}: context_parallel_size={cp} is not supported for its linear-attention "
                         "layers (a cp shard's recurrence needs the previous shard's final state): use "
                         f"context_parallel_size 1 (pure Ulysses, sequence_parallel_size {sp})")
    if nk % sp or nv % sp:
        ok = [d for d in range(1, nk + 1) if nk % d == 0 and nv % d == 0]
        raise ValueError(f"{cfg.model_type}: sequence_parallel_size={sp} does not divide linear_num_key_heads={nk} "
                         f"and linear_num_value_heads={nv} (Ulysses splits the linear layers by heads): use one of {ok}")


# ---- the all-to-all -------------------------------------------------------------------------------------

def seq_to_heads(parts: list[torch.Tensor], group, sp: int) -> list[torch.Tensor]:
    """[bs, sl/sp, H_i, F_i] each -> [bs, sl, H_i/sp, F_i] each (this rank's heads, the full sequence), one exchange."""
    bs, sl_l = parts[0].shape[:2]
    packed = torch.cat([p.reshape(bs, sl_l, sp, -1) for p in parts], dim=-1)  # [bs, sl/sp, sp, sum H_i F_i / sp]
    out = comm.all_to_all(packed.permute(2, 0, 1, 3), group)  # [sp (sequence shard), bs, sl/sp, ..]
    out = out.permute(1, 0, 2, 3).reshape(bs, sp * sl_l, -1)
    sizes = [p.shape[2] // sp * p.shape[3] for p in parts]
    return [o.reshape(bs, sp * sl_l, p.shape[2] // sp, p.shape[3]) for o, p in zip(out.split(sizes, -1), parts)]


def heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[bs, sl, h, F] (this rank's h heads) -> [bs, sl/sp, sp * h, F] (every head, this rank's tokens)."""
    bs, sl, h, f = x.shape
    out = comm.all_to_all(x.reshape(bs, sp, sl // sp, h, f).transpose(0, 1), group)  # [sp (heads), ..]
    return out.permute(1, 2, 0, 3, 4).reshape(bs, sl // sp, sp * h, f)


# ---- document restarts ----------------------------------------------------------------------------------

def documents(position_ids: torch.Tensor | None, bs: int, group, sp: int) -> torch.Tensor | None:
    """[bs, sl] bool, True where a document begins in the FULL sequence, or None when no row restarts. Built once
    per micro-batch (keyed by the identity of the local position-ids tensor every layer receives): one all-gather
    of the position ids under SP and one host sync."""
    if position_ids is None:
        return None
    from model_utils.attention import Documents, _version

    for key, ver, starts in _POS:
        if key is position_ids and ver == _version(position_ids):
            return starts

    full = position_ids
    if sp > 1:
        full = torch.cat(list(comm.gather_stack(position_ids, group, sp)), dim=-1)  # [sp, bs, sl/sp] -> [bs, sl]
    start = Documents(full, bs).start
    starts = start if bool(start[:, 1:].any()) else None  # the host sync
    _POS.append((position_ids, _version(position_ids), starts))
    del _POS[:-4]
    return starts


def doc_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: torch.Tensor | None,
             activation: str) -> torch.Tensor:
    """Causal depthwise conv1d of x [bs, C, sl] with weight [C, K], restarted (zero history) at every True of start
    [bs, sl]; then the activation. Without restarts: one conv1d, as transformers' causal_conv1d_fn."""
    from transformers.activations import ACT2FN

    c, k = weight.shape
    sl = x.shape[-1]
    x = x.to(weight.dtype)
    if start is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=k - 1, groups=c)[..., :sl]
    else:  # out[t] = sum_j w[K-1-j] x[t-j] over t-j in t's document: K shifted multiply-adds
        idx = torch.arange(sl, device=x.device)
        dist_from_start = idx - torch.where(start, idx, 0).cummax(dim=-1).values  # [bs, sl]
        out = x * weight[:, k - 1, None]
        for j in range(1, k):
            valid = (dist_from_start >= j)[:, None, :].to(x.dtype)  # [bs, 1, sl]
            out = out + F.pad(x, (j, 0))[..., :sl] * weight[:, k - 1 - j, None] * valid
        if bias is not None:
            out = out + bias[:, None]
    return ACT2FN[activation](out)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, start: torch.Tensor | None = None, chunk: int = CHUNK):
    """transformers' torch_chunk_gated_delta_rule (qk l2-normalized, no initial state) with the recurrent state
    restarted at every True of start [bs, sl]. query/key [bs, sl, hk, dk], value [bs, sl, hv, dv], g/beta
    [bs, sl, hv] -> [bs, sl, hv, dv].

    The restart is a segment mask inside each chunk (seg = starts so far in the chunk): decays only pair tokens of
    one segment, only segment 0 reads the state carried in, only the last segment writes the state carried out,
    and a chunk with a start drops the carried state. Exact (no large negative decay standing in for a reset)."""
    dtype = query.dtype
    bs, sl, hk, dk = key.shape
    hv = value.shape[2]
    if hk != hv:  # grouped: each q/k head serves hv // hk consecutive v heads
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    query, key, value, beta, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    query, key = _l2norm(query), _l2norm(key)
    query = query * dk ** -0.5
    pad = (-sl) % chunk
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (sl + pad) // chunk
    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, k_beta, v_beta = (x.reshape(bs, hv, n, chunk, -1) for x in (query, key, k_beta, v_beta))
    cum = g.reshape(bs, hv, n, chunk).cumsum(-1)  # [bs, hv, n, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    if start is None:
        seg = torch.zeros(1, 1, n, chunk, dtype=torch.int32, device=query.device)
    else:
        seg = F.pad(start, (0, pad)).reshape(bs, 1, n, chunk).cumsum(-1)  # [bs, 1, n, C]
    apart = upper | (seg[..., :, None] != seg[..., None, :])  # [bs|1, 1, n, C, C]: no decay path between the two
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(apart, float("-inf")).exp()
    first, last = (seg == 0).float(), (seg == seg[..., -1:]).float()  # reads the carried state / writes it
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * (cum.exp() * first)[..., None], upper=False,
                                               unitriangular=True)
    query = query * (cum.exp() * first)[..., None]
    key = key * ((cum[..., -1:] - cum).exp() * last)[..., None]
    carry = (cum[..., -1].exp() * first[..., -1])[..., None, None]  # [bs, hv, n, 1, 1]
    state = query.new_zeros(bs, hv, dk, value.shape[-1])
    outs = []
    for i in range(n):  # the scan over chunks: state [bs, hv, dk, dv]
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * carry[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(bs, hv, n * chunk, -1)[:, :, :sl]
    return out.transpose(1, 2).to(dtype).contiguous()


def _fla_rule(query, key, value, g, beta, start):
    """fla's kernel with the documents as varlen rows (batch rows flattened): UNTESTED here (no GPU)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    bs, sl = query.shape[:2]
    flat = start.flatten() if start is not None else torch.zeros(bs * sl, dtype=torch.bool, device=query.device)
    flat = flat.clone()
    flat[::sl] = True
    cu = torch.cat([flat.nonzero()[:, 0], torch.full((1,), bs * sl, dtype=torch.long, device=flat.device)])
    q, k, v, gg, b = (x.reshape(1, bs * sl, *x.shape[2:]) for x in (query, key, value, g, beta))
    out, _ = fla_chunk(q, k, v, g=gg, beta=b, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return out.reshape(bs, sl, *out.shape[2:])


def _rule(query, key, value, g, beta, start):
    if query.is_cuda:
        try:
            return _fla_rule(query, key, value, g, beta, start)
        except ImportError:
            pass
    return chunk_gated_delta_rule(query, key, value, g, beta, start)


# ---- the layer --------------------------------------------------------------------------------------------

def _project(m, x):
    """Per token: q, k [bs, sl, nk, dk], v, z [bs, sl, nv, dv], b, a [bs, sl, nv, 1] (before the conv)."""
    bs, sl = x.shape[:2]
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: q/k/v/z interleaved per k head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    else:  # Qwen3.5: [q | k | v] channels, z, b, a apart
        q, k, v = m.in_proj_qkv(x).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        z, b, a = m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)
    q, k = (t.reshape(bs, sl, m.num_k_heads, m.head_k_dim) for t in (q, k))
    v, z = (t.reshape(bs, sl, m.num_v_heads, m.head_v_dim) for t in (v, z))
    return q, k, v, z, b.reshape(bs, sl, m.num_v_heads, 1), a.reshape(bs, sl, m.num_v_heads, 1)


def _forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """The GatedDeltaNet forward: Ulysses by heads, documents restarted (see the module docstring)."""
    group, sp = self._lt_group, self._lt_sp
    if cache_params is not None or attention_mask is not None:  # generation / padding: transformers' own path
        if sp > 1:
            raise ValueError(f"{type(self).__name__}: a KV cache or padding mask is not supported under sequence "
                             "parallelism (training feeds packed samples without either)")
        return self._lt_orig_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                     **kwargs)
    _STATE["modules"].add(id(self))
    bs = hidden_states.shape[0]
    rank = comm.rank(group) if sp > 1 else 0
    nk, nv = self.num_k_heads // sp, self.num_v_heads // sp  # this rank's heads
    q, k, v, z, b, a = _project(self, hidden_states)
    if sp > 1:
        q, k, v, z, b, a = seq_to_heads([q, k, v, z, b, a], group, sp)  # [bs, sl, heads/sp, ..]
    sl = q.shape[1]
    start = documents(self._lt_position_ids, bs, group, sp)
    dk, dv = self.head_k_dim, self.head_v_dim
    ch = torch.arange(nk * dk, device=q.device) + rank * nk * dk
    ch = torch.cat([ch, ch + self.key_dim, torch.arange(nv * dv, device=q.device) + rank * nv * dv + 2 * self.key_dim])
    weight = self.conv1d.weight.squeeze(1)[ch]  # [C_local, K]: this rank's q | k | v channels
    bias = self.conv1d.bias[ch] if self.conv1d.bias is not None else None
    mixed = torch.cat([q.reshape(bs, sl, -1), k.reshape(bs, sl, -1), v.reshape(bs, sl, -1)], dim=-1)
    mixed = doc_conv(mixed.transpose(1, 2), weight, bias, start, self.activation).transpose(1, 2)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.reshape(bs, sl, nk, dk), k.reshape(bs, sl, nk, dk), v.reshape(bs, sl, nv, dv)
    heads = slice(rank * nv, (rank + 1) * nv)
    beta = b[..., 0].sigmoid()
    g = -self.A_log[heads].float().exp() * F.softplus(a[..., 0].float() + self.dt_bias[heads])
    out = _rule(q, k, v, g, beta, start)  # [bs, sl, nv/sp, dv]
    out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(bs, sl, nv, dv)
    if sp > 1:
        out = heads_to_seq(out, group, sp)  # [bs, sl/sp, nv, dv]
    return self.out_proj(out.reshape(bs, out.shape[1], -1))


def _keep_positions(layer, args, kwargs):
    layer.linear_attn._lt_position_ids = kwargs.get("position_ids")


def install(model, group=None, sp: int = 1) -> int:
    """Replace the forward of every GatedDeltaNet of `model` (its decoder layer hands it the position ids);
    `group`: the SP group (None at sp 1). Returns how many layers. Idempotent: a later stage re-installs."""
    n = 0
    for layer in getattr(model, "module", model).modules():
        m = getattr(layer, "linear_attn", None)
        if m is None or not type(m).__name__.endswith("GatedDeltaNet"):
            continue
        if not hasattr(m, "_lt_orig_forward"):
            m._lt_orig_forward = m.forward
            m.forward = types.MethodType(_forward, m)
            layer.register_forward_pre_hook(_keep_positions, with_kwargs=True)
            m._lt_position_ids = None
        m._lt_group, m._lt_sp = group, sp
        n += 1
    _POS.clear()
    _STATE["modules"] = set()
    return n


def check_routed(model) -> None:
    """After the first forward: every linear-attention layer ran through `_forward` (one line otherwise)."""
    model = getattr(model, "module", model)
    cfg = _text(model)
    want = sum(t == "linear_attention" for t in (getattr(cfg, "layer_types", None) or ()))
    if want and len(_STATE["modules"]) != want:
        raise ValueError(f"{type(model).__name__}: {len(_STATE['modules'])} of its {want} linear-attention layers ran "
                         "through model_utils/linear_attention (Ulysses by heads, documents restarted): use a model "
                         f"type among {', '.join(LINEAR_MODEL_TYPES)}")
