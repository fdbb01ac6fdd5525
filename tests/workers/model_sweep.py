"""Worker for tests/multiproc/test_model_sweep.py: many model types in one SP launch, each through the start-up
check train.py runs (`families.check_config`, before any weight is read) and, when it passes, one step of the real
engine on packed documents (tests/workers/doc_masking.run_case: ZeRO-3 + CPU offload, document-masked Ulysses
attention, then `check_routed`).

Per case rank 0 writes `<out>.json`: {"status": "refused", "detail": the line} for a start-up refusal, "ran" (the
loss and gradients are in `<out>`, written by run_case), or "crash" with the exception's last line, so that one
type's crash is a failed row of the sweep, not a lost launch. Both ranks take the same path (the same model and
checks); a crash on one rank only reaches the other through the collective timeout and is recorded there too.
Run under tests.distributed.spawn.
"""

import json
import sys
import traceback
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")

from base.parallel import check_layout  # noqa: E402
from model_utils import attention, ulysses  # noqa: E402
from model_utils.build import load_hf_config  # noqa: E402
from model_utils.families import check_config  # noqa: E402
from tests.workers.doc_masking import run_case  # noqa: E402


def sweep_case(case: dict) -> dict:
    try:
        hf = load_hf_config(case["model_name_or_path"])
        check_config(hf, case["attn_implementation"])
        t = hf.get_text_config()
        check_layout(2, case["sequence_parallel_size"], t.num_attention_heads, t.num_key_value_heads,
                     case["max_seq_length"])
    except ValueError as err:  # train.py's start-up refusal: one line, before the process group or any weight
        return {"status": "refused", "detail": str(err)}
    except Exception as err:  # a start-up check that itself crashes: a failed row, not a lost launch
        return {"status": "crash", "detail": f"{type(err).__name__} in the start-up checks: {err}"[:400]}
    try:
        run_case(case)
        return {"status": "ran"}
    except Exception as err:  # a crash of this type; the next type starts from a clean registration
        last = traceback.format_exception_only(err)[-1].strip()
        return {"status": "crash", "detail": f"{type(err).__name__} in the SP step: {last}"[:400]}
    finally:
        ulysses.unregister()
        attention.restore()


if __name__ == "__main__":
    from base.parallel import init_distributed
    from tests.distributed import DIST_TIMEOUT_S

    init_distributed(2, timeout_s=DIST_TIMEOUT_S)  # up front: a case refused at start-up still meets the barrier
    for case in json.loads(sys.argv[1]):
        result = sweep_case(case)
        if dist.get_rank() == 0:
            with open(case["out"] + ".json", "w") as fh:
                json.dump(result, fh)
        dist.barrier()
