"""File formats a target arrives in: what a GGUF file holds (gguf_file.py), its RoPE scaling
as Hugging Face parameters (gguf_rope.py), and the exact group-wise 4-bit and 8-bit codes of
its blocks (quant_codes.py). Imports no other room, so config.py can check a GGUF at load."""
