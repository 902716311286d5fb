"""Each API's request shape, declared once (msgspec Structs): the source of its validation, of
`/openapi.json` and of docs/clients.md's field table (docs/design/requests.md "Request models")."""
