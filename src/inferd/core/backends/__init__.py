"""Runtimes for the forward pass: torch eager, ONNX Runtime, OpenVINO (the contract in base.py; opening one,
with its export cache, in factory.py)."""
