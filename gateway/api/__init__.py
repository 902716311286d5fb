"""The three HTTP APIs (OpenAI chat/completions, Anthropic Messages, OpenAI Responses): request
validation, response bodies and the published OpenAPI description."""
