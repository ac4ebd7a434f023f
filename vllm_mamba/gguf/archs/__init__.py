"""The built-in GGUF architectures, one module each (each calls `register_gguf_architecture`)."""
