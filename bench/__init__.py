"""Benchmarks (layer 6: above the library, train.py and the tools; below the tests). Each module runs from the
repository root as `python -m bench.<name>` and writes its JSON (and PNG) under bench/results/; the shared
harness (ROOT, launching ranks, reading their metrics, writing JSON, printing tables) is bench/harness.py.
Only the results a page of docs/ cites are committed (.gitignore); raw run folders (bench/_runs*) are not."""
