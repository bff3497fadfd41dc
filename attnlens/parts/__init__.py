"""Mechanisms several families share (a sparse mixture of experts, layers without softmax attention, a multimodal
wrapper, ALiBi, sinks, parallel blocks, gates), the score function and the identity oracle, and the data types a
family states its facts in (`Sizes`, `VLLMLayout`). No family module imports a mechanism from another family module.
"""
