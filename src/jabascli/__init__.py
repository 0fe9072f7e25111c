"""jabas: Joint Adaptive Batching and Automatic Scaling on IIDP, for stock PyTorch."""

__version__ = "0.1.0"
