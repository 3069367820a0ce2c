"""Slot expansion of expanded draft nodes (docs/method.md §2-3): draft softmax, top-S
ranked support, tail mass, tail law, Gumbel-max draw of the sampled token from injected
noise, the proxy weight, and the K child slots (DET / SAMPLED / PAD) with their scores.

Three implementations with one signature (``slot_expansion``): ``reference`` (readable
torch), ``cpu`` (numba, what the CPU pipeline uses) and ``triton`` (GPU; runs on CPU
under ``TRITON_INTERPRET=1``).
"""

from rheoplan.kernels.slot_expansion.reference import PROXY_CODES, SlotExpansion

__all__ = ["PROXY_CODES", "SlotExpansion"]
