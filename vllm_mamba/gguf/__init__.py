"""GGUF files (llama.cpp's format): read as a checkpoint format, their blocks kept quantised."""
