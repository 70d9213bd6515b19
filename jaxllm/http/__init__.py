"""The HTTP transport of jaxllm, apart from the model code: vLLM's embeddings API subset.

    jaxllm.http.client     VLLMClient: token ids -> vectors from stock vLLM or the built-in server (stdlib only)
    jaxllm.http.server     python -m jaxllm.http.server --model tiny: that API on Starlette/uvicorn (docs/SERVER.md)
    jaxllm.http.service    the server's request limits, validation and response bodies (no HTTP)
    jaxllm.http.batching   gathers concurrent requests into bucketed encoder calls of bounded size

Nothing here is imported by ``import jaxllm``; the model code does not depend on this package.
"""
