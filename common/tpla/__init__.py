"""TPLA reparameterization (calibration, transforms, convert), the oracle, and fidelity eval."""
