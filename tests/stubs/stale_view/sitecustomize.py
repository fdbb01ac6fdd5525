"""A stale view of the shared file system for one rank, as a node whose NFS cache lags behind the others'.

Python imports this at start-up when tests/stubs/stale_view is on PYTHONPATH. In the process whose RANK is
STALE_VIEW_RANK, paths matching (re.search) the regexes:
- STALE_VIEW_UNLISTED: left out of os.listdir (a cached directory listing, older than the folder);
- STALE_VIEW_MISSING: not found by os.path.exists / isfile / isdir either (a cached "no such file");
- STALE_VIEW_GHOST: found by os.path.exists / isfile although gone (a removed file the cache remembers).
Other processes are untouched.
"""

import os
import re

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("STALE_VIEW_RANK"):
    def _regex(name: str):
        return re.compile(os.environ[name]) if os.environ.get(name) else None

    _unlisted, _missing, _ghost = _regex("STALE_VIEW_UNLISTED"), _regex("STALE_VIEW_MISSING"), _regex("STALE_VIEW_GHOST")
    _real = {"listdir": os.listdir, "exists": os.path.exists, "isfile": os.path.isfile, "isdir": os.path.isdir}

    def _listdir(path="."):
        hidden = [r for r in (_unlisted, _missing) if r]
        return [n for n in _real["listdir"](path)
                if not any(r.search(os.path.join(os.fsdecode(path), n)) for r in hidden)]

    def _lookup(kind: str):
        def look(path) -> bool:
            p = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else str(path)
            if _ghost and _ghost.search(p) and kind != "isdir":
                return True
            if _missing and _missing.search(p):
                return False
            return _real[kind](path)
        return look

    os.listdir = _listdir
    os.path.exists, os.path.isfile, os.path.isdir = _lookup("exists"), _lookup("isfile"), _lookup("isdir")
