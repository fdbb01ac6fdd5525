"""The ring (model_utils/ring_attention.py) at cp 3 and 4 in ONE process: each cp rank is a thread, and
base.comm.RingShift's own code runs over a thread mailbox standing in for torch.distributed's p2p (the `dist` names
it reads at call time: get_rank / get_global_rank / P2POp / batch_isend_irecv). Output and dQ / dK / dV of every rank
equal one dense document / causal / window mask over the whole sequence.

At cp 2 the next and the previous rank are the same rank, and rank - i = rank + i (mod 2): a ring sent the wrong
way round (RingShift's next / previous swapped) or a backward pairing a rank's queries with the block of rank + i
instead of rank - i passes every cp-2 test (tests/multiproc/test_context_parallel.py runs cp 2). cp 3 and 4 see
both (mutation audit mutA: M07, M07b)."""

from __future__ import annotations

import threading

import pytest
import torch

from base import comm
from model_utils import attention
from model_utils import context_parallel as cpm
from model_utils import ring_attention as ra
from tests.unit.model_utils.test_ring_attention import _dense

_tl = threading.local()  # .rank: the cp rank this thread plays


class _Req:
    def __init__(self, box: _Mailbox, key: tuple, t: torch.Tensor):
        self.box, self.key, self.t = box, key, t

    def wait(self) -> None:
        with self.box.cv:
            arrived = self.box.cv.wait_for(lambda: self.key in self.box.box, timeout=20)
            assert arrived, f"rank {_tl.rank}: nothing arrived for (from, to, n) = {self.key}"
            self.t.copy_(self.box.box.pop(self.key))


class _Mailbox:
    """torch.distributed's p2p names as base.comm uses them; message n from rank s to rank r is keyed (s, r, n), so
    a receive gets exactly the matching send, as NCCL's ordered p2p channels deliver it."""

    isend, irecv = "isend", "irecv"

    def __init__(self, n: int):
        self.n, self.box, self.cv, self.sent, self.recvd = n, {}, threading.Condition(), {}, {}

    def get_world_size(self, group=None) -> int:
        return self.n

    def get_rank(self, group=None) -> int:
        return _tl.rank

    def get_global_rank(self, group, r: int) -> int:
        return r

    def P2POp(self, op, t, peer, group=None):  # noqa: N802 (torch.distributed's name)
        return op, t, peer

    def batch_isend_irecv(self, ops) -> list[_Req]:
        me, reqs = _tl.rank, []
        for op, t, peer in ops:
            if op == self.isend:
                with self.cv:
                    n = self.sent.get((me, peer), 0)
                    self.sent[(me, peer)] = n + 1
                    self.box[(me, peer, n)] = t.clone()
                    self.cv.notify_all()
            else:
                n = self.recvd.get((peer, me), 0)
                self.recvd[(peer, me)] = n + 1
                reqs.append(_Req(self, (peer, me, n), t))
        return reqs


@pytest.mark.parametrize("cp,bounds,window", [(3, [0, 1, 14, 23, 36], None), (3, [0, 5, 30, 36], 7),
                                              (4, [0, 17, 18, 48], None), (4, [0, 11, 48], 6)])
def test_ring_at_cp_3_and_4_equals_one_dense_mask(cp, bounds, window, monkeypatch):
    sl, hq, hkv, d = bounds[-1], 2, 1, 4
    monkeypatch.setattr(comm, "dist", _Mailbox(cp))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, h, sl, d) for h in (hq, hkv, hkv, hq))
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    ranges = [cpm.local_ranges(sl, cp, c) for c in range(cp)]
    idx = [torch.cat([torch.arange(a, b) for a, b in ranges[c]]) for c in range(cp)]
    got, errors = {}, []

    def rank(c: int) -> None:
        try:
            _tl.rank = c
            spec = ra.Spec(None, cp, c, ranges, attention.Documents(pos, 1), window, d ** -0.5, "sdpa")
            ql, kl, vl = (t[:, :, idx[c]].clone().requires_grad_() for t in (q, k, v))
            out = ra.ring_attention(ql, kl, vl, spec)  # [1, T, hq, d]
            out.backward(do[:, :, idx[c]].transpose(1, 2))
            got[c] = out.detach().transpose(1, 2), ql.grad, kl.grad, vl.grad
        except BaseException as e:  # noqa: BLE001 (reported below, on the test's thread)
            errors.append((c, repr(e)))

    threads = [threading.Thread(target=rank, args=(c,)) for c in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    want, _ = _dense(qq, kk, vv, attention.Documents(pos, 1).doc, window, d ** -0.5)
    want.backward(do)
    for c in range(cp):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got[c], (want, qq.grad, kk.grad, vv.grad)):
            torch.testing.assert_close(g, w[:, :, idx[c]], atol=1e-5, rtol=1e-5, msg=f"cp rank {c}: {name}")
