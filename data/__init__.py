"""Data: tokenizers, JSONL reading, packing to a stage length, resumable sampling, SP sharding, demo corpus."""
