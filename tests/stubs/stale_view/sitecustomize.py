"""A stale view of the shared file system for one rank, as a node whose NFS cache lags behind the others'.

Python imports this at start-up when tests/stubs/stale_view is on PYTHONPATH. In the process whose RANK is
STALE_VIEW_RANK, paths matching (re.search) the regexes:
- STALE_VIEW_UNLISTED: left out of os.listdir (a cached directory listing, older than the folder);
- STALE_VIEW_MISSING: not found by os.path.exists / isfile / isdir either (a cached "no such file");
- STALE_VIEW_GHOST: found by os.path.exists / isfile although gone (a removed file the cache remembers);
- STALE_VIEW_LATE: not found by any lookup (exists, isfile, os.stat, open, listdir) until STALE_VIEW_LATE_S
  seconds after this process first looked it up (a negative lookup the node caches until it expires).
Other processes are untouched.
"""

import builtins
import os
import re
import time

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("STALE_VIEW_RANK"):
    def _regex(name: str):
        return re.compile(os.environ[name]) if os.environ.get(name) else None

    _unlisted, _missing, _ghost = _regex("STALE_VIEW_UNLISTED"), _regex("STALE_VIEW_MISSING"), _regex("STALE_VIEW_GHOST")
    _late, _late_s, _first_look = _regex("STALE_VIEW_LATE"), float(os.environ.get("STALE_VIEW_LATE_S", "0")), {}
    _real = {"listdir": os.listdir, "exists": os.path.exists, "isfile": os.path.isfile, "isdir": os.path.isdir,
             "stat": os.stat, "open": builtins.open}

    def _name(path) -> str:
        return os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else str(path)

    def _not_yet(p: str) -> bool:
        if not (_late and _late.search(p)):
            return False
        return time.monotonic() - _first_look.setdefault(p, time.monotonic()) < _late_s

    def _listdir(path="."):
        hidden = [r for r in (_unlisted, _missing) if r]
        names = []
        for n in _real["listdir"](path):
            p = os.path.join(_name(path), n)
            if not any(r.search(p) for r in hidden) and not _not_yet(p):
                names.append(n)
        return names

    def _lookup(kind: str):
        def look(path) -> bool:
            p = _name(path)
            if _ghost and _ghost.search(p) and kind != "isdir":
                return True
            if (_missing and _missing.search(p)) or _not_yet(p):
                return False
            return _real[kind](path)
        return look

    def _stat(path, *args, **kwargs):
        if not isinstance(path, int) and _not_yet(_name(path)):
            raise FileNotFoundError(2, "No such file or directory (stale view)", _name(path))
        return _real["stat"](path, *args, **kwargs)

    def _open(file, *args, **kwargs):
        if not isinstance(file, int) and _not_yet(_name(file)):
            raise FileNotFoundError(2, "No such file or directory (stale view)", _name(file))
        return _real["open"](file, *args, **kwargs)

    os.listdir, os.stat, builtins.open = _listdir, _stat, _open
    os.path.exists, os.path.isfile, os.path.isdir = _lookup("exists"), _lookup("isfile"), _lookup("isdir")
