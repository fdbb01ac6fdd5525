"""Headwise-chunked attention (UPipe's "untied Ulysses"): a layer's attention runs n chunks of heads one after another.

For each chunk c of the query heads (and the KV heads they read): the q/k/v projections of those heads only, the
model's own attention code (RoPE, q/k norms, windows: transformers' forward, run on a view of the module whose
projections are the chunk's rows), the registered attention function (document masking; Ulysses' all-to-all and
context parallelism around it, ulysses.py: one DeepSpeed `UlyssesSPAttentionHF` per chunk shape) and the all-to-all
back; the output projection of those heads is added into the layer's output in place. Per rank, a chunk's full-sequence
q, k, v and output are 1/n of the layer's, so the attention part of a layer's working set shrinks n-fold (the
planner's terms: planner/attention_sp.py; the exact bytes: tests/unit/planner/test_planner_tensor_bytes.py).

The whole chunk loop is one autograd Function (`_Chunked`), so backward also runs chunk by chunk. What a finished
chunk leaves alive for backward, by design: the attention KERNEL's outputs of that chunk (its output [bs, hc/u, S,
d] and fp32 log-sum-exp [bs, hc/u, S]: ~1/n of a [T, nh*d] tensor per chunk, ~1 [T, h] for the layer) and nothing
else; the layer input x (shared by all chunks) and the RoPE cos/sin. When x is the lean RMSNorm's output, what that
norm keeps (its input and 1/rms) stands for x, and backward recomputes x from it (model_utils/rmsnorm.py): no
[T, h] of x is kept by the layer's attention at all. Backward,
per chunk: recompute the chunk's projections and all-to-all, answer the kernel from its saved outputs (no second
attention forward: the quadratic part), run the chunk's own backward, and accumulate dx and the weight gradients in
place (addmm_): no [T, h] tensor per chunk, and the chunk's q, k, v freed before the next chunk's projections. (The
kernel is answered with fresh aliases of the saved outputs: answered with the saved tensors themselves, which autograd
then tied to the chunk's graph, every chunk's q, k, v stayed alive until the backward returned, 16 GiB at 1M tokens
with 16 chunks; tests/unit/model_utils/test_head_chunks_release.py.)
Costs against unchunked attention: the chunk's projections and the q/k/v
all-to-all (and the output's all-to-all back) once more in backward, and n times the launches of each collective,
each 1/n the bytes (Llama-3-8B at 1M tokens, SP 8, n = 4: 4 launches of 64 MB instead of 1 of 256 MB per all-to-all).
A kernel that is not one of model_utils.memory.attention_ops (flex_attention's higher-order op, SDPA's math fallback)
is recomputed in backward instead: right, one attention forward more.

Under activation checkpointing the Function saves through the checkpoint like any op (its saved kernel outputs are
dropped in the forward and rebuilt by the recompute), and with --keep_attention the layer's cached kernel outputs
answer the recompute's calls: the kernel runs once per chunk in the forward, never again.
The forward accumulates the output in the compute dtype (bf16: n roundings of partial sums where one o_proj matmul
has one). Evaluation (no autograd) runs the same loop without saving anything.
"""

from __future__ import annotations

import collections
import sys
import types

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from model_utils.engagement import engaged, missing_norm_source
from model_utils.rmsnorm import norm_source, renorm
from planner.attention_sp import check_head_chunks, chunk_heads
from planner.shapes import head_chunks_refusal

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


class _View:
    """What transformers' attention forward sees as `self` for one head chunk: q/k/v_proj return the chunk's
    projections (computed outside, so backward can start from them), o_proj hands back its input (the chunk's
    attention output after the all-to-all back, [bs, T, hc*d]); everything else is the real module's. Attributes
    set on it (DeepSpeed sets num_key_value_groups when it replicates KV heads) stay on the view."""

    def __init__(self, module, q, k, v, groups: int):
        self.__dict__.update(_chunk_of=module, _qkv={"q_proj": q, "k_proj": k, "v_proj": v},
                             num_key_value_groups=groups, y=None)

    def __getattr__(self, name):
        if name in ("q_proj", "k_proj", "v_proj"):
            return lambda x, t=self._qkv[name]: t
        if name == "o_proj":
            def keep(y):
                self.__dict__["y"] = y
                return y
            return keep
        return getattr(self._chunk_of, name)


def _pack(t):
    # detached: a node saving its own output through a hook that returns the tensor itself would hold it with its
    # grad_fn, a cycle through C++ that Python's gc cannot see (measured: every chunk's graph stayed alive)
    return t.detach()


def _unpack(t):
    return t


class _Plan:
    """One call of one attention module: its chunk geometry, the call's arguments (position embeddings, position
    ids, window: captured, not saved tensors) and the model's own forward to run per chunk."""

    def __init__(self, module, chunks: int, hidden_shape, position_embeddings, kwargs, attention_mask=None):
        self.module, self.n, self.kwargs, self.attention_mask = module, chunks, kwargs, attention_mask
        self.position_embeddings = position_embeddings
        self.names = [n for n, _ in module.named_parameters()]
        cfg = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
        self.hq, self.hkv = chunk_heads(nh, nkv, chunks)
        self.d, self.group = d, nh // nkv

    def rows(self, c: int) -> tuple[slice, slice]:
        """(query rows = o_proj columns, key/value rows) of chunk c in the projection weights."""
        q0 = c * self.hq
        k0 = q0 // self.group  # the chunk's first KV head (chunks hold whole groups or lie inside one)
        return slice(q0 * self.d, (q0 + self.hq) * self.d), slice(k0 * self.d, (k0 + self.hkv) * self.d)

    def project(self, x, W: dict, c: int):
        """The chunk's q [bs, T, hq*d], k, v [bs, T, hkv*d] (no autograd: backward starts from them)."""
        qr, kr = self.rows(c)

        def lin(name, r):
            b = W.get(f"{name}.bias")
            return torch.nn.functional.linear(x, W[f"{name}.weight"][r], None if b is None else b[r])

        with torch.no_grad():
            return lin("q_proj", qr), lin("k_proj", kr), lin("v_proj", kr)

    def run(self, q, k, v, x):
        """transformers' attention forward for one chunk -> its output after the all-to-all back, [bs, T, hq*d]."""
        view = _View(self.module, q, k, v, self.hq // self.hkv)
        # the mask (eager's additive [bs, 1, q, k], sdpa's boolean one, flex's BlockMask) is the same for every head:
        # each chunk passes it whole, as the unchunked call does
        type(self.module).forward(view, x, position_embeddings=self.position_embeddings,
                                  attention_mask=self.attention_mask, **self.kwargs)
        return view.y


def _local_graph():
    """Grad on, and our own saved-tensor hooks: a chunk's graph lives only while we use it, whatever checkpoint
    (and its pack hooks) surrounds the layer."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x, *params):
        from model_utils.memory import KeepKernels, attention_ops

        W = dict(zip(plan.names, params))
        ops = attention_ops()
        out = _output(x, W)
        flat_out = out.view(-1, out.shape[-1])
        kept, layouts = [], []
        for c in range(plan.n):
            q, k, v = plan.project(x, W, c)
            cache: collections.deque = collections.deque()
            # grad on, as in backward's recompute: SDPA picks its kernel (and whether it returns the log-sum-exp)
            # from requires_grad, so the cached outputs are what the recompute's call would have returned
            with torch.enable_grad(), _local_graph(), KeepKernels(ops, cache, False, who="head chunks"):
                y = plan.run(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), x)
            qr, _ = plan.rows(c)
            flat_out.addmm_(y.detach().reshape(-1, y.shape[-1]), W["o_proj.weight"][:, qr].t())
            del y, q, k, v  # the chunk's graph (its q/k/v/output at full length) goes here
            leaves, spec = tree_flatten(list(cache))
            layouts.append((spec, [isinstance(t, torch.Tensor) for t in leaves], len(leaves)))
            kept += leaves
        tensors = [t for t in kept if isinstance(t, torch.Tensor)]
        ctx.plan, ctx.layouts, ctx.params = plan, layouts, params
        ctx.others = [t for t in kept if not isinstance(t, torch.Tensor)]
        # x is the input norm's output: when that norm is the lean one, keep what it keeps already (its input and
        # 1/rms) and recompute x in backward, not a [T, h] copy of its own (model_utils/rmsnorm.norm_source)
        source = norm_source(x)
        ctx.x_shape, ctx.renorm = x.shape, source is not None
        ctx.save_for_backward(*(source if source is not None else (x,)), *tensors)
        return out

    @staticmethod
    def backward(ctx, dout):
        from model_utils.memory import KeepKernels, attention_ops

        plan = ctx.plan
        if ctx.renorm:  # the layer input's norm output, recomputed (bitwise equal): one [T, h] while backward runs
            xr, w, rstd, *tensors = ctx.saved_tensors
            x = renorm(xr, w, rstd).view(ctx.x_shape)
            del xr, w, rstd
        else:
            x, *tensors = ctx.saved_tensors
        tensors.reverse()
        others = list(reversed(ctx.others))
        W = {n: p.detach() for n, p in zip(plan.names, ctx.params)}
        grads = {n: torch.zeros_like(p) if p.requires_grad else None for n, p in zip(plan.names, ctx.params)}
        extra = [(n, p) for n, p in zip(plan.names, ctx.params) if n.split(".")[0] not in PROJ and p.requires_grad]
        dx = torch.zeros_like(x) if ctx.needs_input_grad[1] else None
        d2 = dout.reshape(-1, dout.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        ops = attention_ops()
        for c in range(plan.n):
            spec, is_t, count = ctx.layouts[c]
            leaves = [tensors.pop() if t else others.pop() for t in is_t]
            cache = collections.deque(tree_unflatten(leaves, spec) if count else [])
            del leaves
            qr, kr = plan.rows(c)
            q, k, v = (t.requires_grad_() for t in plan.project(x, W, c))
            with torch.enable_grad(), _local_graph(), KeepKernels(ops, cache, True, who="head chunks"):
                y = plan.run(q, k, v, x)
            del cache
            y2 = y.detach().reshape(-1, y.shape[-1])
            Wo = W["o_proj.weight"][:, qr]
            if grads["o_proj.weight"] is not None:
                grads["o_proj.weight"][:, qr].addmm_(d2.t(), y2)
            dy = (d2 @ Wo).view_as(y)
            inputs = [q, k, v] + [p for _, p in extra]
            got = torch.autograd.grad(y, inputs, dy, allow_unused=True)
            del y, y2, dy
            for name, r, g in (("q_proj", qr, got[0]), ("k_proj", kr, got[1]), ("v_proj", kr, got[2])):
                g2 = g.reshape(-1, g.shape[-1])
                if dx is not None:
                    dx.view(-1, dx.shape[-1]).addmm_(g2, W[f"{name}.weight"][r])
                if grads[f"{name}.weight"] is not None:
                    grads[f"{name}.weight"][r].addmm_(g2.t(), x2)
                if grads.get(f"{name}.bias") is not None:
                    grads[f"{name}.bias"][r] += g2.sum(0)
            for (n, _), g in zip(extra, got[3:]):
                if g is not None:
                    grads[n] += g
            del got, inputs, g, g2, q, k, v  # this chunk's projections and gradients, before the next chunk's
        if grads.get("o_proj.bias") is not None:
            grads["o_proj.bias"] += d2.sum(0)
        # The weight gradients go into .grad here, not through autograd (DeepSpeed's TiledMLP does the same): ZeRO-3
        # reduces a leaf module's gradients in the module's backward hook, which fires as soon as dx is returned
        for n, p in zip(plan.names, ctx.params):
            g = grads[n]
            if g is None:
                continue
            if p.grad is None or p.grad.shape != p.shape:
                p.grad = g
            else:
                p.grad.add_(g)
        return (None, dx, *(None for _ in plan.names))


def _output(x, W: dict) -> torch.Tensor:
    """The layer's attention output buffer [bs, T, h]: o_proj's bias, or zeros."""
    Wo, bo = W["o_proj.weight"], W.get("o_proj.bias")
    shape = (*x.shape[:-1], Wo.shape[0])
    return bo.to(x.dtype).expand(shape).clone() if bo is not None else x.new_zeros(shape)


def chunked_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                    **kwargs):
    """The attention module's forward, n chunks of heads at a time, with or without an attention mask (a mask is
    head-independent: every chunk gets it whole). Only a KV cache (generation: no gradients, nothing the memory plan
    counts) runs the model's own forward. It used to run unchunked whenever a mask was passed (eager attention
    always builds one; a padding mask under sdpa), while the planner counted the chunks' saving."""
    n = self._head_chunks
    if n == 1 or past_key_values is not None:
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    plan = _Plan(self, n, hidden_states.shape, position_embeddings, kwargs, attention_mask)
    params = [p for _, p in self.named_parameters()]
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in params)):
        engaged("attention_head_chunks")  # per layer and micro-batch (model_utils/engagement.py)
        if norm_source(hidden_states) is not None:  # _Chunked keeps the norm's input for x: one [T, h] fewer
            engaged("norm_recompute")
        else:  # the plan counted it: stop before the layer's backward needs the [T, h] it did not count
            missing_norm_source(self, f"{type(self).__name__} (chunked attention)")
        return _Chunked.apply(plan, hidden_states, *params), None
    W = dict(zip(plan.names, params))
    out = _output(hidden_states, W)
    for c in range(n):  # evaluation: nothing saved
        q, k, v = plan.project(hidden_states, W, c)
        y = plan.run(q, k, v, hidden_states)
        out.view(-1, out.shape[-1]).addmm_(y.reshape(-1, y.shape[-1]), W["o_proj.weight"][:, plan.rows(c)[0]].t())
    return out, None


def attention_modules(model) -> list:
    layers = getattr(model.get_decoder(), "layers", None) or []
    return [layer.self_attn for layer in layers if hasattr(layer, "self_attn")]


def install(model, chunks: int, ulysses: int = 1) -> int:
    """Run every decoder layer's attention in `chunks` chunks of heads (1: leave it). Returns the chunks; a
    one-line ValueError for a count that does not split the heads per rank, a family not checked chunked
    (planner.shapes.head_chunks_refusal), or an attention module this cannot slice (it needs q/k/v/o_proj Linear
    layers and head_dim, as Llama, Mistral, Qwen2/3, Gemma-3 have)."""
    cfg = model.config.get_text_config()
    check_head_chunks(chunks, cfg.num_attention_heads, cfg.num_key_value_heads, ulysses)
    if chunks == 1:
        return 1
    why = head_chunks_refusal(cfg)  # families.check_supported refuses it at start-up already; install is reachable alone
    if why:
        raise ValueError(f"attention_head_chunks={chunks}: {type(model).__name__} ({cfg.model_type}) {why}; use "
                         "attention_head_chunks 1")
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_module

    mods = attention_modules(model)
    if len(mods) != cfg.num_hidden_layers:
        raise ValueError(f"attention_head_chunks={chunks}: {type(model).__name__} has no decoder layers with a "
                         "self_attn module; use attention_head_chunks 1")
    for m in mods:
        if not all(isinstance(getattr(m, p, None), torch.nn.Linear) for p in PROJ) or not hasattr(m, "head_dim"):
            raise ValueError(f"attention_head_chunks={chunks}: {type(m).__name__} lacks q/k/v/o_proj linear layers or "
                             "head_dim; use attention_head_chunks 1")
        if "apply_rotary_pos_emb" not in vars(sys.modules[type(m).__module__]):
            raise ValueError(f"attention_head_chunks={chunks}: {type(m).__name__} does not use RoPE the Llama way; "
                             "use attention_head_chunks 1")
        m._head_chunks = chunks
        m.forward = types.MethodType(chunked_forward, m)  # this instance only
        # ZeRO-3 leaf: the projections' weights are read as tensors, not through their modules' forward, so they
        # are gathered once for the whole attention module (forward and backward), as the unchunked path's are
        set_z3_leaf_module(m, True)
        if not getattr(m, "_head_chunks_positional", False):
            m.register_forward_pre_hook(_positional_input, with_kwargs=True, prepend=True)
            m._head_chunks_positional = True
    return chunks


def _positional_input(module, args, kwargs):
    """The layer's input as a positional argument that requires grad, before any other hook sees the call.

    ZeRO-3 reduces a leaf module's gradients in a full backward hook (stage3's reduce_leaf_module_grads), which fires
    when the gradient of the module's positional tensor inputs is computed, i.e. after _Chunked.backward has written
    the weight gradients. transformers' decoder layers pass `hidden_states=` as a keyword: the hook then sees no input
    and fires as soon as the OUTPUT's gradient arrives, before that backward runs: it reduced zeros and left the real
    gradients in .grad, unreduced (q/k/v stopped learning after the first step; on CPU the next zero_grad failed). A
    layer input that does not require grad (frozen embeddings) is made a leaf that does, for the same reason: it
    changes no gradient, since nothing upstream of it needs one."""
    if args or "hidden_states" not in kwargs:
        return None
    kwargs = dict(kwargs)
    x = kwargs.pop("hidden_states")
    if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in module.parameters()):
        x = x.detach().requires_grad_()
    return (x,), kwargs
