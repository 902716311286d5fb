"""From messages to prompt token ids: the tokenizer, the chat template and prefix-stable history
rendering (a returned turn renders as the exact tokens the model generated)."""
