"""The GPU check's two short probes (issue 49), in bench.gpu's own process before any launch:

- `kernels`: which attention kernel is fastest for the headline's calls, measured, not assumed from what is
  installed. One head chunk's call as the headline makes it (bf16, [1, heads per chunk, T, 128], causal, no mask:
  one document; K/V as transformers hands them: model_utils/attention_pick.hf_sdpa, under transformers 5.x
  enable_gqa=True with the KV heads not repeated where a chunk has more query than KV heads), forward and backward,
  through SDPA's default dispatch (and the backend that dispatch picks, torch._fused_sdp_choice), SDPA forced to
  each of its flash, cuDNN and memory-efficient backends, and flash-attn's FA2 where installed. Per backend: a warm-up at WARM tokens with torch.profiler recording the CUDA
  kernels' names, then one timed forward and one timed backward at T (CUDA events), the TFLOP/s of each (causal
  attention counted once: 4 T^2 d heads / 2 forward, 2.5x that backward). An error (a backend that refuses the
  shape, out of memory) is a row, not the end of the check.
  At T = 1,109,646 and one head: 0.3 PFLOP forward, ~1 s per backend at 400 TFLOP/s.
- `arena`: base/host_arena.py's exact-size page-locked slots on this machine: seconds per GiB to register
  (page_locked: mmap + first touch + cudaHostRegister) and to unregister, a device -> host copy into the slot
  (GB/s), against torch's pinned allocation of the same bytes, and which path ran (registered or the fallback).

`--dry` (CPU): both run at tiny sizes through the same code (no CUDA: SDPA's default only, the arena's pageable path).
"""

from __future__ import annotations

import contextlib
import time

GiB = 2**30
WARM = 8192  # tokens of the warm-up call (kernel selection, workspace, profiler names)
CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable", -1: "error"}


def sdpa_choice(q, k, v, is_causal: bool = True, attn_mask=None, enable_gqa: bool = False) -> str:
    """The backend SDPA's default dispatch picks for these arguments (the same C++ selection the call runs)."""
    import torch

    try:
        return CHOICE.get(int(torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                                                           enable_gqa=enable_gqa)), "?")
    except Exception as e:  # a torch without the private entry point
        return f"unknown ({type(e).__name__})"


def _backends(cuda: bool) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = [("sdpa default", contextlib.nullcontext)]
    if cuda:
        rows += [("sdpa flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
                 ("sdpa cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
                 ("sdpa efficient", lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION))]
    return rows


def _call(name: str, q, k, v):
    from model_utils.attention_pick import hf_sdpa

    if name == "flash-attn FA2":
        from flash_attn import flash_attn_func

        # flash-attn's layout: [bs, T, heads, d]
        return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    return hf_sdpa(q, k, v)


def _kernel_names(prof) -> list[str]:
    names = {e.name for e in prof.events() if getattr(e, "device_type", None) is not None
             and "CUDA" in str(e.device_type)}
    keep = [n for n in names if any(s in n.lower() for s in ("flash", "fmha", "attn", "attention", "cudnn", "sdpa",
                                                            "softmax", "mem_eff", "cutlass"))]
    return sorted(keep or names)[:8]


def time_backends(length: int, heads: int, kv_heads: int, head_dim: int, device: str) -> list[dict]:
    """One row per backend: the kernels it ran, forward and backward seconds at `length`, TFLOP/s, or its error."""
    import torch

    from model_utils.attention_pick import hf_gqa

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = _backends(cuda)
    try:
        import flash_attn  # noqa: F401

        if cuda:
            rows.append(("flash-attn FA2", contextlib.nullcontext))
    except ImportError:
        pass
    flop_fwd = 4 * length * length * head_dim * heads / 2  # causal: half the square, once

    def tensors(n: int):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
        k = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
        v = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
        return q, k, v  # the KV heads as they are: _call hands them on as transformers does (hf_sdpa)

    out = []
    for name, ctx in rows:
        row = {"backend": name, "length": length, "heads": heads, "head_dim": head_dim,
               "dtype": str(dtype).removeprefix("torch.")}
        try:
            q, k, v = tensors(min(WARM, length))
            if name == "sdpa default":
                row["dispatch"] = sdpa_choice(q, k, v, enable_gqa=hf_gqa(q, k, v))
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with ctx(), torch.profiler.profile(activities=acts) as prof:
                o = _call(name, q, k, v)
                o.float().sum().backward()
            row["kernels"] = _kernel_names(prof) if cuda else []
            del q, k, v, o
            q, k, v = tensors(length)
            if name == "sdpa default":
                row["dispatch_at_length"] = sdpa_choice(q, k, v, enable_gqa=hf_gqa(q, k, v))
            row["forward_s"], row["backward_s"] = _measure(name, ctx, q, k, v, cuda)
            row["forward_tflops"] = round(flop_fwd / row["forward_s"] / 1e12, 1)
            row["backward_tflops"] = round(2.5 * flop_fwd / row["backward_s"] / 1e12, 1)
            row["ok"] = True
            del q, k, v
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        if cuda:
            torch.cuda.empty_cache()
        out.append(row)
    ok = [r for r in out if r.get("ok")]
    if ok:
        best = min(ok, key=lambda r: r["forward_s"] + r["backward_s"])
        for r in out:
            r["fastest"] = r is best
    return out


def _measure(name: str, ctx, q, k, v, cuda: bool) -> tuple[float, float]:
    """Seconds of one forward and of its backward (the incoming gradient all ones)."""
    import torch

    with ctx():
        o, fwd = _timed(lambda: _call(name, q, k, v), cuda)
        grad = torch.ones_like(o)
        _, bwd = _timed(lambda: o.backward(grad), cuda)
    return fwd, bwd


def _timed(fn, cuda: bool):
    import torch

    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        r = fn()
        b.record()
        torch.cuda.synchronize()
        return r, round(a.elapsed_time(b) / 1000, 4)
    t0 = time.perf_counter()
    r = fn()
    return r, round(time.perf_counter() - t0, 4)


def arena_probe(sizes_gib: list[float], device: str) -> dict:
    """base/host_arena.page_locked at each size: seconds to register (and per GiB), a device -> host copy into it
    (GB/s), seconds to unregister; torch's pinned allocation of the same bytes for comparison; the path that ran."""
    import torch

    from base import host_arena

    cuda = device == "cuda"
    rows = []
    for gib in sizes_gib:
        n = int(gib * GiB)
        row = {"gib": gib}
        try:
            t0 = time.perf_counter()
            buf = host_arena.page_locked(n)
            row["register_s"] = round(time.perf_counter() - t0, 3)
            row["register_s_per_gib"] = round(row["register_s"] / gib, 3)
            row["is_pinned"] = bool(buf.is_pinned()) if cuda else False
            if cuda:
                src = torch.empty(n, dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                buf.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                row["d2h_gb_s"] = round(n / (time.perf_counter() - t0) / 1e9, 1)
                del src
            t0 = time.perf_counter()
            host_arena.unlock(buf)
            del buf
            row["unregister_s"] = round(time.perf_counter() - t0, 3)
            if cuda:
                t0 = time.perf_counter()
                p = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                p.fill_(0)  # first touch, as registration pays it
                row["torch_pinned_s"] = round(time.perf_counter() - t0, 3)
                del p
                torch.cuda.empty_cache()
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return {"rows": rows, "path": host_arena.path(), "stats": dict(host_arena.STATS)}
