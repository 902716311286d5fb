"""Each API's request shape, declared once (msgspec Structs): the source of its validation, of
`/openapi.json` and of docs/clients.md's field table (docs/design/requests.md "Request models")."""

from switchyard.gateway.request.wire import anthropic, common, openai, responses

__all__ = ["anthropic", "common", "openai", "responses"]
