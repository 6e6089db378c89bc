"""The SGLang CPU tier: what `make sglang-env` adds to a stock SGLang wheel so its PD pair runs on CPUs.

Ours, not SGLang's: the requirement filter (`requirements.py`), the source patcher
(`patch_sources.py`) and the stand-in `sgl_kernel` module (`stubs/sgl_kernel`).
docs/sglang-cpu-tier.md says what each one is for.
"""
