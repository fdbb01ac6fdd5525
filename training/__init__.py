"""Layer 4, the training machinery: config tree, DeepSpeed config, engine, step, checkpoints and train state,
curriculum, evaluation, metrics, preemption, start-up checks (docs/architecture.md)."""
