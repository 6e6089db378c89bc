"""pdchaos: fault-injection qualification for prefill/decode disaggregated LLM serving."""

__version__ = "0.1.0"
