"""The ZeRO-3 leaf marking of the tiled MLP on this CPU (2 ranks, SP=2, h256, 4 layers, 8192 tokens, 16 tiles of
512 tokens), two rounds in flipped order, against no tiled MLP. From the repo root:

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.gpu_h200.cpu_leaf     # writes /tmp/cpu_leaf.json
"""

import json
import os

from bench import harness as bm


def main() -> None:
    model = bm.bench_model(256, 4)
    os.environ["PYTHONPATH"] = os.path.join(bm.ROOT, "bench", "gpu_h200", "probe_site")
    work = "/tmp/cpu_leaf"
    os.makedirs(work, exist_ok=True)
    res = []
    keep = ("tokens_per_s", "peak_mem_gb", "ok")
    for rnd in range(2):
        cases = [("leaf", {}), ("no leaf", {"PROBE_NO_LEAF": "1"})]
        for name, env in cases[:: 1 if rnd % 2 == 0 else -1]:
            r = bm.train_point(model, 8192, 2, ("tiled_mlp",), 4, "cpu", work, nproc=2,
                               env={**env, "PROBE_MLP_TILE_TOKENS": "512"})
            print(rnd, name, r.get("tokens_per_s"), r.get("peak_mem_gb"), r.get("error", "")[:200], flush=True)
            res.append({"round": rnd, "name": name, **{k: r.get(k) for k in keep}})
        r = bm.train_point(model, 8192, 2, (), 4, "cpu", work, nproc=2)
        print(rnd, "untiled", r.get("tokens_per_s"), r.get("peak_mem_gb"), flush=True)
        res.append({"round": rnd, "name": "untiled", **{k: r.get(k) for k in keep}})
    with open("/tmp/cpu_leaf.json", "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
