"""Layer 1, the base: process-group communication (the one owner of collectives), the parallel layout and the
shared-folder checks, rank-0 printing and rank logs, host readings, the process environment for DeepSpeed's
ops. Imports nothing of the project (docs/architecture.md)."""
