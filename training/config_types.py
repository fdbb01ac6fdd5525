"""A recipe's values typed as the config's fields declare them (training/config.py), before anything compares them.

YAML reads `learning_rate: 1e-4` as the string "1e-4" (YAML 1.1 wants a dot: 1.0e-4), `max_tokens: 2e9` likewise,
and a key left empty as null. Each value of a recipe (top level and each stage) is checked against its field's
declared type: a number written as text becomes the number (an integer field takes 2e9 or 1000.0, not 2.5); a number
given where a string is declared (`resume: 5`) becomes its text, except for the keys that take `auto` or N
(`context_parallel_size: 2` stays the integer their readers check for); anything else (a list
for a number, "yes" for a boolean, null for a field that has no None) is refused in one line naming the key, the value
and what it takes. Before, such a value reached the checks as it came and failed there with a TypeError traceback.
Command-line values are typed by argparse already and pass unchanged.
"""

from __future__ import annotations

import dataclasses

import yaml

AUTO_OR_INT = ("context_parallel_size", "attention_head_chunks", "sequence_parallel_size")  # declared str ("auto"), an int from a recipe
YES_NO = ("reset_position_ids",)  # auto | yes | no: YAML 1.1 reads a bare yes / no as a boolean
HINTS = {"eval": "use true or false at the top level (a stage's settings go in its eval: block, the run's in "
                 "eval_heldout_samples, eval_tasks, eval_depths, ...)"}  # a key whose usual mistake has a fix to name
_WANT = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "dict": "a mapping",
         "list": "a list"}


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return None
    return None


def typed(key: str, value, tp: str, where: str):
    """`value` as field `key` of declared type `tp` ("int", "float | None", "bool | str", ...) takes it; ValueError,
    one line, for a value it cannot take."""
    kinds = {t.strip().split("[")[0] for t in tp.split("|")}
    if value is None:
        if "None" in kinds:
            return None
    elif isinstance(value, bool):
        if "bool" in kinds:
            return value
        if key in YES_NO:  # `reset_position_ids: no` in a recipe (documented), read by YAML as false
            return "yes" if value else "no"
    elif isinstance(value, dict | list):
        if type(value).__name__ in kinds:
            return value
    else:  # a number or a string
        num = _number(value)
        if "int" in kinds and "float" not in kinds and num is not None and num.is_integer():
            return int(num)
        if "float" in kinds and num is not None:
            return value if isinstance(value, int | float) else num
        if "str" in kinds:  # a number kept where the field takes `auto` or N (its readers check for an int)
            return value if isinstance(value, str) or key in AUTO_OR_INT else str(value)
    if key in HINTS:
        raise ValueError(f"{key}: {value!r:.60}: {HINTS[key]}")
    want = " or ".join(_WANT[k] for k in _WANT if k in kinds)
    raise ValueError(f"{key}: {value!r:.60} in {where} is not {want}")


def typed_fields(d: dict, cls, where: str) -> dict:
    """d's values typed by `cls`'s fields (keys `cls` lacks are left to the caller's unknown-key check)."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    check_stages(d.get("stages"), where)
    return {k: typed(k, v, types[k], where) if k in types and k != "stages" else v for k, v in d.items()}


def check_stages(value, where: str) -> None:
    """A recipe's `stages`: a list (or absent), else one line."""
    if not isinstance(value or [], list):
        raise ValueError(f"stages: {value!r:.60} in {where} is not a list of stage mappings")


class _DuplicateKey(ValueError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """safe_load's loader that refuses a key given twice in one mapping, at any depth: PyYAML keeps the last without a
    word (`stages:` twice dropped the first list's stages, `max_steps` twice took the last). Merge keys (`<<: *base`)
    still merge: the keys written beside one override the merged ones, as YAML says."""

    def flatten_mapping(self, node):  # before PyYAML merges an anchor's pairs into its node (a shallower merge of
        self._unique(node)  # an anchor that holds a merge itself flattened it first: its merged key read as twice)
        super().flatten_mapping(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self._unique(node)
        return super().construct_mapping(node, deep)

    def _unique(self, node) -> None:
        """Each mapping node checked once, as written (before any merge changed it)."""
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen[key] = line
                except TypeError:  # an unhashable key: the parent's own error names it
                    continue
                if first is not None:
                    raise _DuplicateKey(f"key {key!r} given twice (lines {first} and {line}): YAML keeps only the "
                                        "last; keep one")


def yaml_text(text: str, where: str):
    """A YAML text (a recipe file's, a flag's mapping) read, or ValueError in one line naming where and the line."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader's: no Python objects
    except _DuplicateKey as e:
        raise ValueError(f"{where}: {e}") from None
    except yaml.YAMLError as e:  # ParserError, ScannerError: a traceback of the parser's own state otherwise
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{where}: not valid YAML{at} ({getattr(e, 'problem', None) or 'unreadable'})") from None


def yaml_flag(text: str):
    """argparse's converter for a mapping flag (--rope '{rope_type: yarn, factor: 4.0}')."""
    return yaml_text(text, "the value")


yaml_flag.__name__ = "YAML"  # argparse says "invalid YAML value: '...'"
