"""Wan2.2 (TI2V-5B) video generation: the diffusion transformer (transformer*.py) and the VAE (vae*.py)."""
