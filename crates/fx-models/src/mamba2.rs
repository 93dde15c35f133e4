//! MAMBA-2 (SSD) regressor (in progress).
