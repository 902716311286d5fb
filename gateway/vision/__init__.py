"""Images in requests: each API's image parts, decoding and checking them, and where their
placeholder tokens go in the prompt (docs/design/images.md "Images")."""
