"""A CPU stand-in of flash-attn 2.8.3's varlen forward / backward, with its rules, for the ring's flash path
(model_utils/ring_attention.py `_fa_forward` / `_fa_backward`), which no GPU with flash-attn has run yet.

What it copies from flash-attn's source (csrc/flash_attn/flash_api.cpp mha_varlen_fwd / mha_varlen_bwd and
set_params_fprop, src/mask.h, src/softmax.h; flash_attn/flash_attn_interface.py):
- the ops are torch custom ops `flash_attn::_flash_attn_varlen_forward` / `_backward` (torch.library.custom_op, as
  flash-attn >= 2.7 registers them under torch >= 2.4), with 2.8's signatures: window_size_left / _right, softcap,
  4 outputs forward; dq, dk, dv mutated backward;
- the window conversions: causal sets right = 0 (forward: max_seqlen_q == 1 drops causal first); a window >=
  max_seqlen_k becomes -1; then causal = (left < 0 and right == 0), a missing side of a window becomes max_seqlen_k
  (left >= 0 with right = -1: right = max_seqlen_k: the implicit right limit);
- the mask of each segment of m queries and n keys (its own lengths), aligned bottom-right: query i sees key j
  iff j <= i + n - m (causal), or i + n - m - left <= j <= i + n - m + right (local);
- a query that sees no key: out 0 and lse +inf (softmax.h: `Split ? -INFINITY : INFINITY`).

install(monkeypatch) puts a `flash_attn` package of these (version 2.8.3 unless told) in sys.modules. The ops are
registered once per process and only where the real flash-attn is absent (`REAL`).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

CALLS = {"forward": 0, "backward": 0}
# where the real flash-attn is installed its ops own these names (tests/test_gpu_smoke.py runs it): skip there
REAL = importlib.util.find_spec("flash_attn") is not None


def rules(max_q: int, max_k: int, causal: bool, left: int, right: int, forward: bool) -> tuple[bool, bool, int, int]:
    """(causal, local, left, right) as the kernel sees them, from the arguments of one call."""
    if forward and max_q == 1:
        causal = False  # "causal=true is the same as causal=false in this case"
    if causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    is_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return is_causal, not is_causal and (left >= 0 or right >= 0), left, right


def mask(m: int, n: int, is_causal: bool, local: bool, left: int, right: int) -> torch.Tensor:
    """[m, n] bool: which key each query of one segment sees (mask.h, bottom-right)."""
    i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
    if is_causal:
        return j <= i + n - m
    if local:
        return (j >= i + n - m - left) & (j <= i + n - m + right)
    return torch.ones(m, n, dtype=torch.bool)


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    q, k = cu_q.tolist(), cu_k.tolist()
    return [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]


def _scores(q, k, q0, q1, k0, k1, scale, keep):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float().repeat_interleave(g, 1)) * scale
    return s.masked_fill(~keep, float("-inf"))


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                   softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                   softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                   block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                   seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_softmax
    CALLS["forward"] += 1
    rule = rules(max_seqlen_q, max_seqlen_k, causal, window_size_left, window_size_right, True)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    g = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        keep = mask(q1 - q0, k1 - k0, *rule)
        s = _scores(q, k, q0, q1, k0, k1, softmax_scale, keep)
        seen = keep.any(-1)  # [m]: an empty row keeps out 0, lse +inf
        p = torch.softmax(s[:, seen], -1)
        out[q0:q1][seen] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].float().repeat_interleave(g, 1))
        lse[:, q0:q1][:, seen] = torch.logsumexp(s[:, seen], -1)
    return out.to(q.dtype), lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)


def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                    dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                    window_size_left: int, window_size_right: int, softcap: float,
                    alibi_slopes: torch.Tensor | None, deterministic: bool, rng_state: torch.Tensor | None = None,
                    zero_tensors: bool = False) -> torch.Tensor:
    """dq, dk, dv (written in place) of the GIVEN out / lse: P = exp(S - lse), dS = P (dP - rowsum(dO * O))."""
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    CALLS["backward"] += 1
    rule = rules(max_seqlen_q, max_seqlen_k, causal, window_size_left, window_size_right, False)
    g = q.shape[1] // k.shape[1]
    for t in (dq, dk, dv):
        t.zero_()
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [hq, total_q]
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        keep = mask(q1 - q0, k1 - k0, *rule)
        kk, vv = k[k0:k1].float().repeat_interleave(g, 1), v[k0:k1].float().repeat_interleave(g, 1)
        p = torch.exp(_scores(q, k, q0, q1, k0, k1, softmax_scale, keep) - softmax_lse[:, q0:q1, None])
        dof = dout[q0:q1].float().transpose(0, 1)  # [hq, m, d]
        ds = p * (dof @ vv.permute(1, 2, 0) - delta[:, q0:q1, None])
        dq[q0:q1] += (ds @ kk.transpose(0, 1) * softmax_scale).transpose(0, 1).to(dq.dtype)
        dk_h = ds.transpose(1, 2) @ q[q0:q1].float().transpose(0, 1) * softmax_scale  # [hq, n, d]
        dk[k0:k1] += dk_h.unflatten(0, (-1, g)).sum(1).transpose(0, 1).to(dk.dtype)
        dv[k0:k1] += (p.transpose(1, 2) @ dof).unflatten(0, (-1, g)).sum(1).transpose(0, 1).to(dv.dtype)
    return delta


_REGISTERED: dict = {}


def _ops():
    if "flash_attn" not in _REGISTERED:  # what flash_attn_interface does with torch >= 2.4
        fwd = torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())(varlen_forward)
        bwd = torch.library.custom_op("flash_attn::_flash_attn_varlen_backward",
                                      mutates_args=("dq", "dk", "dv"))(varlen_backward)
        _REGISTERED["flash_attn"] = (fwd, bwd)
    return _REGISTERED["flash_attn"]


def install(monkeypatch, version: str = "2.8.3") -> None:
    """A `flash_attn` package whose flash_attn_interface holds the stand-in ops, for this test."""
    fwd, bwd = _ops()
    pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    pkg.__version__, pkg.flash_attn_interface = version, iface
    iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = fwd, bwd
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
