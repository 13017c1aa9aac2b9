"""Model loading and CPU kernels: specs and embedded models, the native GGUF path (blocks, kernels and their
measured choice, row-wise attention) and float32 oneDNN/int8 layers. May import the core `utils` modules, never a
generator or the chat."""
