"""vllm_patching package."""
