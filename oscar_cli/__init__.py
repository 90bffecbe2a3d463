"""OSCAR-KV: offline spectral covariance-aware rotations for INT2 KV caches."""

__version__ = "0.1.0"
