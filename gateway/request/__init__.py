"""The request model, below the API handlers (gateway/api/) that build it."""
