"""From generated tokens to API output: incremental detokenization and stop strings, and the
split of a model's text into reasoning, answer text and tool calls (each family's formats)."""
