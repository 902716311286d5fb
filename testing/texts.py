"""The prompts greedy parity is checked on, shared by the parity tests and bench/kv_bits.py
(which measures how far a quantized KV cache strays from them)."""

MAX_TOKENS = 40  # greedy tokens compared per prompt
SHORT_TEXT = "The old mill stands by the river, and every morning the miller"
# Longer than one prefill chunk (512) and several KV pages (256): chunked prefill and page
# writes happen on the server while the reference prefills in one piece.
LONG_TEXT = " ".join(f"Line {i}: the {w} river runs past the {w} hill to the sea."
                     for i, w in enumerate(["north", "south", "east", "west"] * 12))

REPEAT_TEXT = " ".join(f"Step {i}: carry the {w} stone up the {w} stair." for i, w in
                       enumerate(["red", "green", "blue"] * 20))
