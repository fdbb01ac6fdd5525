"""Layer 2, the planner: model shapes, memory features and their tile/chunk rules, the memory and cost model,
the per-stage chooser. Torch-free; the runtime patches read their rules from here (docs/architecture.md)."""
