"""The training machinery: config tree, parallel layout, DeepSpeed config, step, checkpoints, stages, metrics."""
