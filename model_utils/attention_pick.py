"""`--attn_implementation auto` on a GPU: the attention kernel measured fastest on this GPU, not the package that
happens to be installed (issue 49).

Before, `auto` took FlashAttention-2 whenever flash-attn imported. On the H200 (bench/results/gpu.json,
docs/results/gpu.md) SDPA's own dispatch went to cuDNN at 456-500 / 545-578 TFLOP/s forward / backward at the
headline's call, and torch's port of FlashAttention-2's kernels to 302 / 328: installing flash-attn (an optional
package the user is told about) would have made the step ~1.4x slower without a word. On an A100, where SDPA has no
cuDNN kernel this fast, FA2 may win; and a torch build whose SDPA dispatch prefers its flash kernel runs ~1.7x
slower than SDPA forced to cuDNN on the same GPU. So it is measured where the run is:

- no GPU, an fp32 run, or a family FA2 cannot run (attention sinks): sdpa, as before (a GPU run: timed against SDPA
  forced to cuDNN, CUDNN below);
- a stage runs the context-parallel ring (asked, or the plan needs it to fit): flash_attention_2, the GPU ring's
  kernel (model_utils/context_parallel.register refuses the ring otherwise); a layer with a sliding window too
  (`candidates`: SDPA would run it as masked chunks on its slowest kernel);
- otherwise rank 0 times one causal call, forward and backward, per candidate (SDPA's own dispatch; SDPA forced to
  cuDNN; FA2 where flash-attn imports) at the
  run's per-call shape (the query heads a rank attends per head chunk of the first stage, their KV heads, the head
  dim, bf16 / fp16, min(the first stage's length, PROBE_TOKENS) tokens), the median of 3 after a warm-up, and every
  rank takes rank 0's pick (comm.run_on_main: one decision; the others wait on the host group for its ~1-2 s).

Cost: once per start, on rank 0's GPU before any model is built: ~1-2 s (cuDNN's graph build included) and q, k, v,
out and their gradients at PROBE_TOKENS (32 MiB a tensor at 4 heads of 128). The pick is printed with the timings.
A CUDNN pick runs as attn_implementation sdpa with cuDNN first in SDPA's priority order for the process (`prefer`:
every rank, the probe's kernel; a call cuDNN cannot take falls to the next backend as SDPA's own dispatch would).
"""

from __future__ import annotations

import contextlib
import inspect
import socket
import statistics
from collections.abc import Callable

from base import comm
from base.log import print0

PROBE_TOKENS = 32768
FA2 = "flash_attention_2"
CUDNN = "sdpa_cudnn"  # a probe candidate, not a transformers backend: the run is sdpa with cuDNN preferred (prefer)
_PREFERRED = contextlib.ExitStack()  # holds SDPA's priority order while a CUDNN pick stands (prefer)


def windowed(arch) -> bool:
    """Whether some layer attends within a sliding window (Mistral v0.1, Gemma-2/3's local layers, Qwen2 with
    use_sliding_window, gpt-oss): `layer_types` where the config lists them, else `sliding_window` unless
    `use_sliding_window` is off."""
    types = getattr(arch, "layer_types", None)
    if types:
        return any("sliding" in str(t) for t in types)
    return bool(getattr(arch, "sliding_window", None)) and getattr(arch, "use_sliding_window", True) is not False


def candidates(config, chunks: int | str, needs_ring: bool, flash_importable: bool, check, cudnn: bool = False
               ) -> list[str]:
    """The backends `auto` may run: sdpa, SDPA forced to cuDNN (CUDNN, where `cudnn`: a GPU in bf16 / fp16) and, where
    flash-attn imports and the family allows it (`check(config, backend, chunks)` raises ValueError otherwise; CUDNN is
    sdpa to the family), FA2; FA2 alone where a stage runs the ring (its GPU kernel) or a
    layer has a sliding window (the sdpa path runs a window as masked query chunks, which SDPA's dispatch sends to
    its memory-efficient kernel, the slowest the H200 measured: FA2 applies the window itself). Packed short
    documents also reach SDPA as masked blocks (<= 512 tokens), but their attention is ~1% of a Llama-3-8B step's
    FLOPs at 512 tokens, so the probe's plain causal call stands for where attention's time goes."""
    ok = []
    for backend in ("sdpa", FA2):
        if backend == FA2 and not flash_importable:
            continue
        try:
            check(config, backend, chunks)
        except ValueError:
            continue
        ok.append(backend)
    arch = config.get_text_config() if hasattr(config, "get_text_config") else config
    if needs_ring or windowed(arch):
        return [FA2] if FA2 in ok else ok
    return ok[:1] + [CUDNN] + ok[1:] if cudnn and ok[:1] == ["sdpa"] else ok


def call_shape(arch, sp: int, cp: int, chunks: int, seq_len: int) -> dict:
    """One attention call of the run: the query heads a rank attends per head chunk (after the Ulysses all-to-all),
    their KV heads, the head dim and the probe's length."""
    nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
    hd = getattr(arch, "head_dim", None) or arch.hidden_size // nh
    q = max(1, nh // max(1, sp // max(1, cp)) // max(1, chunks))
    return {"heads": q, "kv_heads": max(1, q * nkv // nh), "head_dim": hd, "tokens": min(seq_len, PROBE_TOKENS)}


def hf_gqa(q, k, v) -> bool:
    """Whether transformers' sdpa path hands SDPA this unmasked call ([b, h, s, d]) with enable_gqa=True and K/V as
    they are (transformers 5.x, its use_gqa_in_sdpa: more query than KV heads, no mask, head dim <= 256 on CUDA),
    not with the KV heads repeated to the query heads (its repeat_kv: a copy of K and V h / hkv times their size)."""
    if k.shape[1] == q.shape[1]:
        return False
    try:
        from transformers.integrations.sdpa_attention import use_gqa_in_sdpa
    except ImportError:
        return False
    n = len(inspect.signature(use_gqa_in_sdpa).parameters)  # (mask, key) before 5.x's (mask, key, value)
    return bool(use_gqa_in_sdpa(*(None, k, v)[:n]))


def hf_sdpa(q, k, v):
    """One causal SDPA call without a mask ([b, h, s, d]) as transformers' sdpa path makes it: enable_gqa=True with
    K/V unrepeated where hf_gqa says so, else the KV heads repeated; SDPA's dispatch picks the kernel for that call."""
    import torch.nn.functional as F

    if hf_gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_call(backend: str, shape: dict, dtype, rounds: int = 3) -> float:
    """Median seconds of one causal call's forward + backward through `backend` on this GPU (after a warm-up): SDPA
    called as transformers calls it (hf_sdpa: under 5.x, enable_gqa=True with the KV heads not repeated); CUDNN: that
    call with SDPA forced to cuDNN (a call it cannot take raises, and pick leaves it out); FA2: flash_attn_func with
    the KV heads as they are (transformers' FA2 path)."""
    import torch

    b, s, h, kv, d = 1, shape["tokens"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for n in (h, kv, kv))
    grad = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
    if backend == FA2:
        from flash_attn import flash_attn_func

        def call(q, k, v):
            return flash_attn_func(q, k, v, causal=True)
    else:
        def call(q, k, v):  # SDPA's own dispatch, as transformers' sdpa path hands it ([b, h, s, d]: hf_sdpa)
            return hf_sdpa(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    if backend == CUDNN:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        forced = lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])  # noqa: E731
    else:
        forced = contextlib.nullcontext
    times = []
    for i in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with forced():
            call(q, k, v).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i:  # the first: the warm-up (cuDNN builds its graph)
            times.append(start.elapsed_time(end) / 1e3)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def pick(options: list[str], shape: dict, dtype, timer: Callable[[str, dict, object], float] | None = None
         ) -> tuple[str, dict[str, float]]:
    """The fastest of `options` by `timer` (default time_call; one option: itself, untimed); a backend whose call
    fails is left out."""
    timer = timer or time_call
    if len(options) == 1:
        return options[0], {}
    times = {}
    for backend in options:
        try:
            times[backend] = timer(backend, shape, dtype)
        except Exception:  # noqa: BLE001 -- a kernel that cannot run this call is not a candidate
            continue
        finally:
            _release()
    if not times:
        return options[0], {}
    return min(times, key=times.get), times


def _release() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the probe's tensors, before the model is built


def line(choice: str, times: dict[str, float], shape: dict) -> str:
    if not times:
        return f"attention: auto runs {choice}"
    timed = ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in sorted(times.items(), key=lambda x: x[1]))
    choice = "sdpa with cuDNN preferred (sdpa_cudnn)" if choice == CUDNN else choice
    return (f"attention: auto runs {choice}, the fastest on this GPU (one causal call forward + backward at "
            f"{shape['tokens']} tokens, {shape['heads']} head(s) of {shape['head_dim']}: {timed})")


def prefer(choice: str) -> str:
    """Make the process run `choice` (settle's pick, on every rank): CUDNN puts cuDNN first in SDPA's priority order
    (torch.nn.attention.sdpa_kernel with set_priority, held open; the other backends stay enabled behind it) and
    returns "sdpa", the transformers backend that runs it; anything else: SDPA's order as it was, `choice`."""
    _PREFERRED.close()  # a pick before it (tests settle more than once in one process)
    if choice != CUDNN:
        return choice
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    _PREFERRED.enter_context(sdpa_kernel(order, set_priority=True))
    return "sdpa"


def measure(provisional: str, config, *, chunks: int, ring: bool, sp: int, cp: int, seq_len: int,
            half: str | None, check) -> tuple[str, dict[str, float], dict]:
    """Rank 0's decision for settle (and the GPU check's auto_attention section, bench/gpu.py): (the pick, the seconds
    of each candidate timed, the call timed); untimed where there is nothing to choose from."""
    import torch

    if half is None:  # fp32: flash-attn and cuDNN have no fp32 kernel
        return ("sdpa" if provisional == FA2 else provisional), {}, {}
    options = candidates(config, chunks, ring, provisional == FA2, check, cudnn=True)
    if len(options) <= 1:  # nothing to measure (the ring, a window, a family with one of them): no probe
        return (options[0] if options else provisional), {}, {}
    arch = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = call_shape(arch, sp, cp, chunks, seq_len)
    return (*pick(options, shape, torch.bfloat16 if half == "bf16" else torch.float16), shape)


def settle(provisional: str, config, *, chunks: int, ring: bool, sp: int, cp: int, seq_len: int, half: str | None,
           check) -> str:
    """`--attn_implementation auto` on a GPU, once process groups exist: rank 0 decides for every rank
    (comm.run_on_main, joined by every GPU rank whatever its own node has). `provisional`: what pick_attn_implementation
    gave on this rank (FA2 where flash-attn imports); `half`: "bf16" / "fp16", None for an fp32 run (flash-attn has no
    fp32 kernel); `chunks`, `sp`, `cp`, `seq_len`: the call the probe times (the first stage's, train.py); `ring`: some
    stage runs the ring. Rank 0: candidates() (FA2 where its flash-attn imports, SDPA forced to cuDNN in bf16 / fp16)
    timed by pick(). A rank told FA2 whose node cannot import flash-attn: one-line ValueError naming its host. Returns
    the transformers backend to run (prefer: a CUDNN pick runs as sdpa with cuDNN first)."""
    def decide():  # rank 0: its flash-attn, its layout, its GPU
        return measure(provisional, config, chunks=chunks, ring=ring, sp=sp, cp=cp, seq_len=seq_len, half=half,
                       check=check)

    choice, times, shape = comm.run_on_main(decide, long=True)  # times kernels at the stage's length
    if times:
        print0(line(choice, times, shape))
    if choice == FA2 and provisional != FA2:
        raise ValueError(f"--attn_implementation auto: rank 0 runs {FA2}, but flash-attn does not import on "
                         f"{socket.gethostname()}: install it on every node, or pass --attn_implementation sdpa")
    return prefer(choice)
