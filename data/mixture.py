"""Per-stage data mixtures: which documents a stage trains on, and in which proportions.

A stage's `data:` in the recipe (None: the whole stream, packed in order) is either a mapping
`{source_glob: weight}` or a list of components:

    data:
      - {name: long, source: "books*", weight: 0.6, min_doc_tokens: 65536}     # ProLong: 60% long documents
      - {name: short, source: ["fineweb", "code*"], weight: 0.4, max_doc_tokens: 65535}
      - {source: arxiv, weight: 0.2, upsample: {min_doc_tokens: 32768, factor: 4}}  # Fu et al.: per source

`source` matches the documents' source names (fnmatch globs; see the manifest's `sources`), `min_doc_tokens`
/ `max_doc_tokens` filter by document length (EOS included), `upsample` repeats a component's long
documents `factor` times (length upsampling inside a source, whose weight stays fixed). Weights are token
shares of the stage (every sample has the stage's length), normalised to sum to 1.

`MixtureSampler` draws each sample's component deterministically (the component furthest below its share
goes next, so the realised shares track the weights within one sample at every point) and the sample inside
the component from a seeded permutation per component epoch. Its state is two counters, identical on
every rank; `source_shares()` gives the realised token share per component since the stage started.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import numpy as np

from data.packing import DocPack

_KEYS = {"name", "source", "weight", "min_doc_tokens", "max_doc_tokens", "upsample"}


@dataclass(frozen=True)
class Component:
    name: str
    sources: tuple[str, ...]  # globs over source names
    weight: float
    min_doc_tokens: int = 0
    max_doc_tokens: int | None = None
    upsample_min_tokens: int = 0
    upsample_factor: int = 1


def _number(value, what: str, whole: bool = True) -> int | float:
    """A recipe's number (YAML gives text for `64k`, `60%`, `4x`, and None for an empty value), else one line: these
    raised int()'s or float()'s own error, or (max_doc_tokens, never converted) numpy's UFuncTypeError when the
    documents were selected."""
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value)
        if not math.isfinite(x) or (whole and x != int(x)):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what} is {value!r}: give a number" + (" of tokens (65536, not 64k)" if "tokens" in what
                         else " (a whole number: 4, not 4x)" if whole else " (0.6 or 60: weights are normalised)")) from None
    return int(x) if whole else x


def parse_mixture(spec, where: str = "data") -> list[Component] | None:
    """The components of a stage's `data:` value (None: no mixture). One-line ValueError on a bad spec."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        spec = [{"source": k, "weight": v} for k, v in spec.items()]
    if not isinstance(spec, list) or not spec:
        raise ValueError(f"{where}: expected {{source: weight, ...}} or a list of components, got {spec!r}")
    comps = []
    for i, c in enumerate(spec):
        if not isinstance(c, dict) or "weight" not in c:
            raise ValueError(f"{where}[{i}]: a component is a mapping with at least `weight`, got {c!r}")
        unknown = sorted(set(c) - _KEYS)
        if unknown:
            raise ValueError(f"{where}[{i}]: unknown key(s) {unknown}; valid: {sorted(_KEYS)}")
        src = c.get("source", "*")
        sources = tuple(src) if isinstance(src, list) else (str(src),)
        up = c.get("upsample") or {}
        if not isinstance(up, dict) or set(up) - {"min_doc_tokens", "factor"}:
            raise ValueError(f"{where}[{i}]: upsample is {{min_doc_tokens: N, factor: F}}, got {up!r}")
        name = c.get("name") or ",".join(sources) + (f">={c['min_doc_tokens']}" if c.get("min_doc_tokens") else "") + (
            f"<={c['max_doc_tokens']}" if c.get("max_doc_tokens") else "")
        at, maxd = f"{where}[{i}] ({name})", c.get("max_doc_tokens")
        comp = Component(name, sources, _number(c["weight"], f"{at}: weight", whole=False),
                         _number(c.get("min_doc_tokens") or 0, f"{at}: min_doc_tokens"),
                         None if maxd is None else _number(maxd, f"{at}: max_doc_tokens"),
                         _number(up.get("min_doc_tokens", 0), f"{at}: upsample.min_doc_tokens"),
                         _number(up.get("factor", 1), f"{at}: upsample.factor"))
        if not comp.weight > 0 or comp.upsample_factor < 1:
            raise ValueError(f"{where}[{i}] ({name}): weight must be > 0 and upsample factor >= 1")
        comps.append(comp)
    names = [c.name for c in comps]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: component names {names} repeat; give each a distinct `name`")
    return comps


def select_documents(comp: Component, source_names: list[str], doc_source: np.ndarray,
                     doc_lens: np.ndarray) -> np.ndarray:
    """Indices of the documents of `comp` in stream order, long ones repeated when upsampled."""
    ids = [i for i, s in enumerate(source_names) if any(fnmatch.fnmatchcase(s, g) for g in comp.sources)]
    keep = np.isin(doc_source, ids) & (doc_lens >= comp.min_doc_tokens) & (doc_lens > 0)
    if comp.max_doc_tokens is not None:
        keep &= doc_lens <= comp.max_doc_tokens
    idx = np.flatnonzero(keep)
    if comp.upsample_factor > 1:  # extra copies after the originals, so copies land far apart
        long = idx[doc_lens[idx] >= comp.upsample_min_tokens]
        idx = np.concatenate([idx] + [long] * (comp.upsample_factor - 1))
    return idx


class MixtureDataset:
    """The components' packed samples side by side: index `offsets[c] + j` is sample j of component c."""

    def __init__(self, parts: list[DocPack], names: list[str]):
        self.parts, self.names = parts, names
        self.sizes = [len(p) for p in parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        c = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[c][i - int(self.offsets[c])]


class MixtureSampler:
    """Resumable weighted sampling over components, at micro-batch granularity, over DP ranks.

    Every rank replays the same global sequence of draws (dp x micro_batch per micro-step) and keeps its
    own slice, so all ranks hold the same counters and the DP ranks read disjoint samples."""

    def __init__(self, sizes: list[int], weights: list[float], names: list[str], dp: int, dp_rank: int,
                 micro_batch: int, seed: int):
        for n, s in zip(names, sizes):
            if s < 1:
                raise ValueError(f"mixture component {n!r} has no complete sample at this stage's length: add "
                                 "documents for it, relax its filters, or drop it from the stage's data")
        total = sum(weights)
        self.sizes, self.names = list(sizes), list(names)
        self.weights = np.asarray(weights, dtype=np.float64) / total
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.dp, self.dp_rank, self.mb, self.seed = dp, dp_rank, micro_batch, seed
        self.drawn, self.counts = 0, np.zeros(len(sizes), dtype=np.int64)
        self._perm: dict[int, tuple[int, np.ndarray]] = {}

    def _sample(self, c: int, j: int) -> int:
        epoch, pos = divmod(j, self.sizes[c])
        cached = self._perm.get(c)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, c, epoch]).permutation(self.sizes[c]))
            self._perm[c] = cached
        return int(self.offsets[c] + cached[1][pos])

    def _draw(self) -> int:
        c = int(np.argmax(self.weights * (self.drawn + 1) - self.counts))  # furthest below its share
        j = int(self.counts[c])
        self.counts[c] += 1
        self.drawn += 1
        return self._sample(c, j)

    def next_batch(self) -> list[int]:
        """Indices (into the MixtureDataset) of this rank's next micro-batch."""
        draws = [self._draw() for _ in range(self.dp * self.mb)]
        return draws[self.dp_rank * self.mb: (self.dp_rank + 1) * self.mb]

    def source_shares(self) -> dict[str, float]:
        """Realised token share of each component since the stage started (all DP ranks together)."""
        return {n: float(c) / max(1, self.drawn) for n, c in zip(self.names, self.counts)}

    packing: str | None = None  # as data/sampler.ResumableSampler's

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "counts": self.counts.tolist(), "names": self.names, "sizes": self.sizes,
                "seed": self.seed, "dp": self.dp, "micro_batch": self.mb,
                **({"packing": self.packing} if self.packing else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the saved draws (also under another DP degree or micro-batch: the global
        sequence of draws does not depend on them)."""
        from data.sampler import check_position  # (torch: imported with the sampler, not with this module)

        check_position(state, "names", self.names)  # one line where the recipe changed (data/sampler.py)
        self.drawn, self.counts, self._perm = int(state["drawn"]), np.asarray(state["counts"], dtype=np.int64), {}
        self.seed = int(state.get("seed", self.seed))  # the run's order, whatever today's --seed
