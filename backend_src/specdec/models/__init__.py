"""Model forwards and checkpoint loaders (target Llama family, EAGLE-1/3 heads, Medusa heads)."""
