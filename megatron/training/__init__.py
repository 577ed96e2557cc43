"""Our training stack on megatron-core: arguments, loop, data, tokenizers, checkpoint glue."""
