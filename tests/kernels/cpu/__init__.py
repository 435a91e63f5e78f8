"""The CPU kernels (kernels/cpu/) and the CPU attention backend (kernels/cpu_backend.py)."""
