"""The configured Hub token, masked wherever mxforge writes or prints text (records, cards, messages)."""

from __future__ import annotations


def redact(text: str) -> str:
    """`text` with the configured token (HF_TOKEN or the saved one) masked."""
    from huggingface_hub import get_token  # lazily: the quantizer and the checkers load without a Hub client

    token = get_token()
    return text.replace(token, "hf_***") if token else text
