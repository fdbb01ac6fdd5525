"""Building the Hugging Face model: presets, loading under ZeRO-3, RoPE per stage, Ulysses, memory features."""
