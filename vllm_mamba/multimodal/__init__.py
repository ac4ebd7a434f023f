"""Image input: what an image becomes on its way into the engine (`inputs`, `prompt`), how a
client's image references are read (`media`), and the engine's image options (`config`)."""
