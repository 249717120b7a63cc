"""The Hugging Face Hub: session limits, errors, transfers, remote source, download, push, card, pull requests."""
