"""Native kernels, optional: every caller has a plain-PyTorch fallback."""
