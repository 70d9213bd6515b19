"""The HTTP transport of jaxllm, apart from the model code: vLLM's embeddings API subset.

    jaxllm.http.client   VLLMClient: token ids -> vectors from stock vLLM or the built-in server (stdlib only)
    jaxllm.http.server   python -m jaxllm.http.server --model tiny: that API in front of jaxllm's own encoder

Nothing here is imported by ``import jaxllm``; the model code does not depend on this package.
"""
