"""The probes of the one-H200 session of 2026-11-24 (docs/results/gpu_h200.md)."""
