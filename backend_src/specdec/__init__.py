"""specdec: a speculative-decoding LLM engine for Triton's Python backend (no Triton imports)."""
