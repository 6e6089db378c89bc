"""Loaded by every Python process of a pdchaos-launched vLLM engine (this directory is on PYTHONPATH)."""

import pdchaos_amx
import pdchaos_nixl_affinity
import pdchaos_nixl_delay

pdchaos_amx.request_tile_state()
pdchaos_nixl_delay.install()
pdchaos_nixl_affinity.install()
