"""Vision-language models: mlx-vlm's classes and processors behind the worker's slots
(docs/design/images.md "Images")."""
