"""Imported by every launch of bench.gpu_h200.probe / .cpu_leaf (on PYTHONPATH): measurement knobs without product flags."""
import os

if os.environ.get("PROBE_MLP_TILE_TOKENS") or os.environ.get("PROBE_NO_LEAF"):
    import model_utils.memory as _m

    if os.environ.get("PROBE_MLP_TILE_TOKENS"):  # tokens per MLP tile instead of the rule
        _m.MLP_TILE_TOKENS = int(os.environ["PROBE_MLP_TILE_TOKENS"])
    if os.environ.get("PROBE_NO_LEAF"):  # the tiled MLP without its ZeRO-3 leaf marking (the code before the fix)
        _m.set_z3_leaf_module = lambda *a, **k: None
