"""Attention beside completions: `attnlens serve`, vLLM's OpenAI-compatible server answering each request's
`attention` field (docs/serve.md). `protocol` holds the request and response fields (`attnlens.row_features` what a
row reduces to), `middleware` the API server's side (the worker's is attnlens/vllm/serving.py), `launch` the command.
"""
