"""Few-row linear products on the CPU: ``reference`` (torch's product), ``cpu`` (numba)."""
