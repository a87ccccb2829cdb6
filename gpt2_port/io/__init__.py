"""Files in and out: the strict safetensors reader and writer, the Conv1D-layout adapter, locating checkpoints and the
Hub, reading a checkpoint into a config and a state dict and writing one back, the tokenizer, text streaming, and
random checkpoints in the official layout. Nothing here imports the model."""
