"""The router: OpenAI-compatible HTTP API over disaggregated prefill/decode (DESIGN §2)."""
