"""The GPU check's document-masking parity (bench/gpu.py's `parity` section): on every attention backend installed
(sdpa, flex_attention, flash_attention_2 where flash-attn is there), the loss and every gradient of a packed sample
of 7 documents through the registered document-masked function equal the plain Hugging Face model run on each
document alone (peaked weights, initializer_range 0.3); the wrong answer (attention across documents) is printed
beside the tolerance."""

from __future__ import annotations

DOC_LENS = [37, 11, 29, 120, 1, 58, 44]  # 300 tokens: a 1-token document, short ones and a long one


def backends(device: str) -> list[str]:
    if device == "cpu":
        return ["sdpa"]  # torch has no flex_attention backward on CPU; flash-attn needs CUDA
    names = ["sdpa", "flex_attention"]
    try:
        import flash_attn  # noqa: F401

        names.append("flash_attention_2")
    except ImportError:
        pass
    return names


def _loss_and_grads(model, ids, pos, labels) -> tuple[float, dict]:
    import torch

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    total = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    total.backward()
    return total.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def doc_parity(device: str) -> list[dict]:
    """Per backend: relative error of the loss and of all gradients (one vector) against the plain model on each
    document alone, and how far the wrong answer (monotonic positions, attention across documents) is."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils import attention
    from model_utils.build import preset_config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = preset_config("tiny-llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, initializer_range=0.3)
    torch.manual_seed(0)
    master = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, 2048, (n,), generator=g) for n in DOC_LENS]
    n_labels = sum(n - 1 for n in DOC_LENS)

    def build(attn: str, dtype):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        m.load_state_dict(master)
        return m.to(device).train()

    def labels_of(d):
        return torch.cat([d[1:], torch.tensor([-100])])

    ref = build("sdpa", torch.float32)  # the oracle: each document alone, plain model, fp32
    ref_loss, ref_grads = 0.0, {}
    for d in docs:
        loss, grads = _loss_and_grads(ref, d[None].to(device), torch.arange(len(d))[None].to(device),
                                      labels_of(d)[None].to(device))
        ref_loss += loss
        for k, v in grads.items():
            ref_grads[k] = ref_grads.get(k, 0) + v
    ids = torch.cat(docs)[None].to(device)
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
    labels = torch.cat([labels_of(d) for d in docs])[None].to(device)
    wrong_loss, _ = _loss_and_grads(ref, ids, torch.arange(ids.shape[1])[None].to(device), labels)
    flat_ref = torch.cat([ref_grads[k].flatten() for k in sorted(ref_grads)])
    out = []
    for attn in backends(device):
        dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
        try:
            model = build(attn, dtype)
            attention.register(model, attn)
            try:
                loss, grads = _loss_and_grads(model, ids, pos, labels)
            finally:
                attention.restore()
        except Exception as e:  # a backend that fails here is a result, not the end of the check
            out.append({"backend": attn, "dtype": str(dtype).removeprefix("torch."), "ok": False,
                        "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        flat = torch.cat([grads[k].flatten() for k in sorted(ref_grads)])
        loss_tol, grad_tol = (2e-2, 5e-2) if dtype == torch.bfloat16 else (1e-5, 1e-4)
        row = {"backend": attn, "dtype": str(dtype).removeprefix("torch."), "loss": loss / n_labels,
               "ref_loss": ref_loss / n_labels, "wrong_loss": wrong_loss / n_labels,
               "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
               "wrong_rel_err": abs(wrong_loss - ref_loss) / abs(ref_loss),
               "grad_rel_err": ((flat - flat_ref).norm() / flat_ref.norm()).item(),
               "loss_tol": loss_tol, "grad_tol": grad_tol}
        row["ok"] = row["loss_rel_err"] <= loss_tol and row["grad_rel_err"] <= grad_tol
        out.append(row)
    return out

