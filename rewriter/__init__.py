"""mm3-codemod: rewrite vLLM's MiniMax-M3 NVIDIA model for an fp8 KV cache on SM89."""

__version__ = "0.1.0"
